"""Parse and validate Anthropic Messages requests (`POST /v1/messages` and `/v1/messages/count_tokens`),
and convert them to the chat conversation the serving layer already serves.

A Messages request keeps its own `body` and `raw` (what goes upstream, as the client sent it) and carries
`chat`: the same turn as an OpenAI chat request (system message, assistant `tool_calls`, role "tool"
results, OpenAI-shaped tools and tool_choice), so prompt rendering, tool-call parsing and constrained
decoding are the chat path's, not a second implementation. What the local engines cannot serve (images,
documents, server tools, extended thinking, an assistant prefill) is named in `unserved`: the turn then
goes upstream, or gets a clear 400 when there is none.

Bad input is a 400 whose message names the field as Anthropic's does (`messages.0.content.1.input:
...`), wherever the request would go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..openai.requests import ApiRequest, ChatRequest, json_object
from ..turns.session import prefix_fingerprint
from .content import (
    Converter,
    Hints,
    as_object,
    convert_tool_choice,
    convert_tools,
    fail,
    is_int,
    number,
    text_blocks,
)


@dataclass(slots=True)
class MessagesRequest(ApiRequest):
    # The turn as a chat request (what the serving layer renders, samples and parses); None only while
    # parsing.
    chat: ChatRequest | None = None
    # Why the local engines cannot serve it (None: they can).
    unserved: str | None = None
    stop_sequences: list[str] = field(default_factory=list)
    count_only: bool = False  # /v1/messages/count_tokens: no answer, no max_tokens

    @property
    def as_chat(self) -> ChatRequest:
        assert self.chat is not None
        return self.chat


# -- the request -----------------------------------------------------------------------------------


def _load(raw: bytes) -> dict[str, Any]:
    body = json_object(raw)
    model = body.get("model")
    if model is None:
        raise fail("model", "Field required")
    if not isinstance(model, str) or not model:
        raise fail("model", "Input should be a non-empty string")
    return body


def _max_tokens(body: dict[str, Any], count_only: bool) -> int | None:
    value = body.get("max_tokens")
    if value is None:
        if count_only:
            return None
        raise fail("max_tokens", "Field required")
    if not is_int(value) or value < 1:
        raise fail("max_tokens", "Input should be a positive integer")
    return int(value)


def _stop_sequences(body: dict[str, Any]) -> list[str]:
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise fail("stop_sequences", "Input should be an array of strings")
    return [s for s in stops if s]


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """temperature (Anthropic's range, 0-1), top_p, top_k and metadata, validated; the first three as
    the chat request carries them."""
    number(body, "temperature", 0.0, 1.0)
    number(body, "top_p", 0.0, 1.0)
    top_k = body.get("top_k")
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise fail("top_k", "Input should be a non-negative integer")
    metadata = body.get("metadata")
    if metadata is not None:
        as_object(metadata, "metadata")
    return {k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}


def _unserved_options(body: dict[str, Any]) -> str | None:
    """Options only Anthropic serves. The rest of what its API takes and a local model has no use for
    (speed, service_tier, inference_geo, output_config.effort, ...) is accepted and does nothing."""
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        return "extended thinking is not served locally"
    for name in ("mcp_servers", "container"):
        if body.get(name):
            return f"{name} is not served locally"
    return None


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """Structured outputs (`output_config.format`, or the older `output_format`: a JSON schema) as the
    chat request's response_format, decoded under the schema's grammar as chat's is."""
    config = body.get("output_config")
    where, fmt = "output_config.format", None
    if config is not None:
        fmt = as_object(config, "output_config").get("format")
    if fmt is None:
        where, fmt = "output_format", body.get("output_format")
    if fmt is None:
        return None
    fmt = as_object(fmt, where)
    if fmt.get("type") != "json_schema":
        raise fail(f"{where}.type", "Input should be 'json_schema'")
    if "schema" not in fmt:
        raise fail(f"{where}.schema", "Field required")
    schema = as_object(fmt["schema"], f"{where}.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def parse_messages(raw: bytes, *, count_only: bool = False) -> MessagesRequest:
    """A Messages request (`count_only`: a count_tokens request, which has no max_tokens), validated,
    with its chat form."""
    body = _load(raw)
    max_tokens = _max_tokens(body, count_only)
    messages = body.get("messages")
    if messages is None:
        raise fail("messages", "Field required")
    if not isinstance(messages, list) or not messages:
        raise fail("messages", "Input should be a non-empty array")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise fail("stream", "Input should be a valid boolean")
    hints = Hints()
    hints.see(body, "")  # top-level cache_control: a breakpoint on the last cacheable block
    chat_messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = text_blocks(body["system"], "system", hints, only_text=True)
        chat_messages.append({"role": "system", "content": system})
    converter = Converter(hints, chat_messages)
    for i, msg in enumerate(messages):
        converter.message(msg, i)
    unserved = converter.unserved
    if messages[-1].get("role") == "assistant":
        unserved = unserved or "a final assistant message (a prefill) is not served locally"
    tools, tools_unserved, tool_names = convert_tools(body, hints)
    choice, parallel = convert_tool_choice(body, tool_names)
    chat_body: dict[str, Any] = {"model": body["model"], "messages": chat_messages, **_sampling(body)}
    if max_tokens is not None:
        chat_body["max_tokens"] = max_tokens
    response_format = _response_format(body)
    if response_format is not None:
        chat_body["response_format"] = response_format
    if tools:
        chat_body.update(tools=tools, tool_choice=choice, parallel_tool_calls=parallel)
    users = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "user")
    chat = ChatRequest(
        body=chat_body,
        raw=b"",  # never sent anywhere: the Messages request goes upstream as the client sent it
        model=body["model"],
        stream=bool(stream),
        include_usage=True,
        turn=max(0, users - 1),
        messages=chat_messages,
    )
    return MessagesRequest(
        body=body,
        raw=raw,
        model=body["model"],
        stream=bool(stream),
        include_usage=True,
        turn=chat.turn,
        retention_hint_s=hints.seconds,
        chat=chat,
        unserved=unserved or tools_unserved or _unserved_options(body),
        stop_sequences=_stop_sequences(body),
        count_only=count_only,
    )


def _without_cache_control(value: Any) -> Any:
    """`value` with every cache_control removed: clients move their cache breakpoints from turn to turn
    (Claude Code marks the latest message), which must not change the conversation's fingerprint."""
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


def messages_fingerprint(body: dict[str, Any]) -> str:
    """A Messages conversation's session without an id: the model, the system prompt and the messages up
    to the first user message, the same on every turn of the conversation."""
    system = {"role": "system", "content": body.get("system")}
    messages = _without_cache_control([system, *(body.get("messages") or [])])
    return prefix_fingerprint(str(body.get("model", "")), messages)
