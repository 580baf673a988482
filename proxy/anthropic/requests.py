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

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..errors import APIError, bad_request
from ..openai.requests import ApiRequest, ChatRequest

# cache_control's ttl -> seconds (no ttl: Anthropic's default, 5 minutes).
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}
ROLES = ("user", "assistant")
TOOL_CHOICES = ("auto", "any", "tool", "none")
# Content blocks the local engines serve; the others (image, document, search_result, ...) go upstream.
SERVED_BLOCKS = ("text", "tool_use", "tool_result")
# Blocks dropped when rendering locally: the model's reasoning of an earlier turn (templates drop it too).
DROPPED_BLOCKS = ("thinking", "redacted_thinking")


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


def _fail(where: str, problem: str) -> APIError:
    return bad_request(f"{where}: {problem}", param=where)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, "Input should be an object")
    return value


def _string(obj: dict[str, Any], key: str, where: str, *, required: bool = True) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise _fail(f"{where}.{key}" if where else key, "Field required")
        return None
    if not isinstance(value, str):
        raise _fail(f"{where}.{key}" if where else key, "Input should be a valid string")
    return value


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise _fail(key, f"Input should be a number between {lo:g} and {hi:g}")


# -- cache_control: the retention hint ---------------------------------------------------------------


def _cache_ttl(block: dict[str, Any], where: str) -> float | None:
    """A block's `cache_control` as seconds, or None without one."""
    control = block.get("cache_control")
    if control is None:
        return None
    where = f"{where}.cache_control" if where else "cache_control"
    control = _object(control, where)
    if control.get("type") != "ephemeral":
        raise _fail(f"{where}.type", "Input should be 'ephemeral'")
    ttl = control.get("ttl", "5m")
    if ttl not in CACHE_TTLS:
        raise _fail(f"{where}.ttl", "Input should be '5m' or '1h'")
    return CACHE_TTLS[ttl]


class _Hints:
    """The longest cache_control ttl seen anywhere in the request (the store's retention hint)."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def see(self, block: dict[str, Any], where: str) -> None:
        ttl = _cache_ttl(block, where)
        if ttl is not None and (self.seconds is None or ttl > self.seconds):
            self.seconds = ttl


# -- content ---------------------------------------------------------------------------------------


def _text_blocks(value: object, where: str, hints: _Hints, *, only_text: bool) -> str:
    """A string, or an array of text blocks joined: `system` (`only_text`: text blocks are all it may
    hold), a tool_result's content (images and documents too, which are not served locally)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _fail(where, "Input should be a string or an array of content blocks")
    texts = []
    for i, raw in enumerate(value):
        block_where = f"{where}.{i}"
        block = _object(raw, block_where)
        kind = _string(block, "type", block_where)
        if kind != "text" and only_text:
            raise _fail(f"{block_where}.type", "Input should be 'text'")
        if kind != "text":
            raise _NotServed(f"{block_where}: {kind!r} blocks are not served locally")
        texts.append(_string(block, "text", block_where))
        hints.see(block, block_where)
    return "\n".join(t for t in texts if t is not None)


class _NotServed(Exception):
    """Valid input the local engines do not serve (the request goes upstream)."""


@dataclass
class _Converter:
    """Anthropic messages -> chat messages, validating as it goes. Content the engines cannot serve
    is still validated as far as its type; the first such thing is remembered in `unserved`."""

    hints: _Hints
    out: list[dict[str, Any]] = field(default_factory=list)
    unserved: str | None = None

    def _not_served(self, reason: str) -> None:
        self.unserved = self.unserved or reason

    def message(self, raw: object, i: int) -> None:
        where = f"messages.{i}"
        msg = _object(raw, where)
        role = msg.get("role")
        if role is None:
            raise _fail(f"{where}.role", "Field required")
        if role not in ROLES:
            raise _fail(f"{where}.role", "Input should be 'user' or 'assistant'")
        if "content" not in msg:
            raise _fail(f"{where}.content", "Field required")
        content = msg["content"]
        if isinstance(content, str):
            self.out.append({"role": role, "content": content})
            return
        if not isinstance(content, list):
            raise _fail(f"{where}.content", "Input should be a string or an array of content blocks")
        before = len(self.out)
        if role == "user":
            self._user(content, where)
        else:
            self._assistant(content, where)
        if len(self.out) == before:  # nothing but dropped blocks: still a turn of its role
            self.out.append({"role": role, "content": ""})

    def _block(self, raw: object, where: str) -> tuple[dict[str, Any], str]:
        block = _object(raw, where)
        kind = _string(block, "type", where)
        assert kind is not None
        self.hints.see(block, where)
        return block, kind

    def _user(self, content: list[Any], where: str) -> None:
        texts: list[str] = []

        def flush() -> None:
            if texts:
                self.out.append({"role": "user", "content": "\n".join(texts)})
                texts.clear()

        for j, raw in enumerate(content):
            block_where = f"{where}.content.{j}"
            block, kind = self._block(raw, block_where)
            if kind == "text":
                texts.append(_string(block, "text", block_where) or "")
            elif kind == "tool_result":
                flush()
                self.out.append(self._tool_result(block, block_where))
            elif kind == "tool_use":
                raise _fail(f"{block_where}.type", "tool_use blocks belong to assistant messages")
            elif kind not in DROPPED_BLOCKS:
                self._not_served(f"{block_where}: {kind!r} blocks are not served locally")
        flush()

    def _tool_result(self, block: dict[str, Any], where: str) -> dict[str, Any]:
        call_id = _string(block, "tool_use_id", where)
        is_error = block.get("is_error", False)
        if is_error is not None and not isinstance(is_error, bool):
            raise _fail(f"{where}.is_error", "Input should be a valid boolean")
        text = ""
        if block.get("content") is not None:
            try:
                text = _text_blocks(block["content"], f"{where}.content", self.hints, only_text=False)
            except _NotServed as exc:
                self._not_served(str(exc))
        if is_error:
            text = f"Error: {text}"
        return {"role": "tool", "tool_call_id": call_id, "content": text}

    def _assistant(self, content: list[Any], where: str) -> None:
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, raw in enumerate(content):
            block_where = f"{where}.content.{j}"
            block, kind = self._block(raw, block_where)
            if kind == "text":
                texts.append(_string(block, "text", block_where) or "")
            elif kind == "tool_use":
                call_id = _string(block, "id", block_where)
                name = _string(block, "name", block_where)
                if "input" not in block:
                    raise _fail(f"{block_where}.input", "Field required")
                arguments = _object(block["input"], f"{block_where}.input")
                # The arguments as the model wrote them (key order kept): the next turn re-renders the
                # same text and reuses its KV.
                fn = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
                calls.append({"id": call_id, "type": "function", "function": fn})
            elif kind == "tool_result":
                raise _fail(f"{block_where}.type", "tool_result blocks belong to user messages")
            elif kind not in DROPPED_BLOCKS:
                self._not_served(f"{block_where}: {kind!r} blocks are not served locally")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        elif message["content"] is None:
            message["content"] = ""
        self.out.append(message)


# -- tools -----------------------------------------------------------------------------------------


def _tools(body: dict[str, Any], hints: _Hints) -> tuple[list[dict[str, Any]], str | None]:
    """Anthropic tools as OpenAI function tools, and why they cannot be served locally (server tools:
    bash, web search, ... run by Anthropic)."""
    tools = body.get("tools")
    if tools is None:
        return [], None
    if not isinstance(tools, list):
        raise _fail("tools", "Input should be a valid array")
    out, unserved = [], None
    for i, raw in enumerate(tools):
        where = f"tools.{i}"
        tool = _object(raw, where)
        hints.see(tool, where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            unserved = unserved or f"{where}: server tools ({kind!r}) are not served locally"
            continue
        name = _string(tool, "name", where)
        description = _string(tool, "description", where, required=False)
        if "input_schema" not in tool:
            raise _fail(f"{where}.input_schema", "Field required")
        schema = _object(tool["input_schema"], f"{where}.input_schema")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if description is not None:
            fn["description"] = description
        out.append({"type": "function", "function": fn})
    return out, unserved


def _tool_choice(body: dict[str, Any], names: list[str]) -> tuple[Any, bool]:
    """Anthropic's tool_choice as OpenAI's (auto, required, a named function, none) and whether
    parallel calls are allowed."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if names else None), True
    choice = _object(choice, "tool_choice")
    kind = choice.get("type")
    if kind not in TOOL_CHOICES:
        raise _fail("tool_choice.type", "Input should be 'auto', 'any', 'tool' or 'none'")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise _fail("tool_choice.disable_parallel_tool_use", "Input should be a valid boolean")
    if kind != "none" and not names:
        raise _fail("tool_choice", f"tool_choice of type {kind!r} needs tools")
    if kind == "tool":
        name = _string(choice, "name", "tool_choice")
        if name not in names:
            raise _fail("tool_choice.name", f"no tool named {name!r} in tools")
        return {"type": "function", "function": {"name": name}}, not parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], not parallel


# -- the request -----------------------------------------------------------------------------------


def _load(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    model = body.get("model")
    if model is None:
        raise _fail("model", "Field required")
    if not isinstance(model, str) or not model:
        raise _fail("model", "Input should be a non-empty string")
    return body


def _max_tokens(body: dict[str, Any], count_only: bool) -> int | None:
    value = body.get("max_tokens")
    if value is None:
        if count_only:
            return None
        raise _fail("max_tokens", "Field required")
    if not _is_int(value) or value < 1:
        raise _fail("max_tokens", "Input should be a positive integer")
    return int(value)


def _stop_sequences(body: dict[str, Any]) -> list[str]:
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _fail("stop_sequences", "Input should be an array of strings")
    return [s for s in stops if s]


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """temperature (Anthropic's range, 0-1), top_p, top_k and metadata, validated; the first three as
    the chat request carries them."""
    _number(body, "temperature", 0.0, 1.0)
    _number(body, "top_p", 0.0, 1.0)
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise _fail("top_k", "Input should be a non-negative integer")
    metadata = body.get("metadata")
    if metadata is not None:
        _object(metadata, "metadata")
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
        fmt = _object(config, "output_config").get("format")
    if fmt is None:
        where, fmt = "output_format", body.get("output_format")
    if fmt is None:
        return None
    fmt = _object(fmt, where)
    if fmt.get("type") != "json_schema":
        raise _fail(f"{where}.type", "Input should be 'json_schema'")
    if "schema" not in fmt:
        raise _fail(f"{where}.schema", "Field required")
    schema = _object(fmt["schema"], f"{where}.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def parse_messages(raw: bytes, *, count_only: bool = False) -> MessagesRequest:
    """A Messages request (`count_only`: a count_tokens request, which has no max_tokens), validated,
    with its chat form."""
    body = _load(raw)
    max_tokens = _max_tokens(body, count_only)
    messages = body.get("messages")
    if messages is None:
        raise _fail("messages", "Field required")
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", "Input should be a non-empty array")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _fail("stream", "Input should be a valid boolean")
    hints = _Hints()
    hints.see(body, "")  # top-level cache_control: a breakpoint on the last cacheable block
    chat_messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _text_blocks(body["system"], "system", hints, only_text=True)
        chat_messages.append({"role": "system", "content": system})
    converter = _Converter(hints, chat_messages)
    for i, msg in enumerate(messages):
        converter.message(msg, i)
    unserved = converter.unserved
    if messages[-1].get("role") == "assistant":
        unserved = unserved or "a final assistant message (a prefill) is not served locally"
    tools, tools_unserved = _tools(body, hints)
    choice, parallel = _tool_choice(body, [t["function"]["name"] for t in tools])
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
    messages = body.get("messages") or []
    end = next((i + 1 for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), 1)
    prefix = _without_cache_control([body.get("model"), body.get("system"), messages[:end]])
    return "fp-" + hashlib.sha256(orjson.dumps(prefix, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
