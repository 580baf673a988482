"""Parse and validate the bodies of the three turn endpoints (orjson): Chat Completions, (legacy)
Completions and Responses. Bad input is a 400 naming the param, wherever the request would go.

Each request keeps `body` (the dict forwarded or served, the proxy's own fields removed) and `raw` (the
original bytes, forwarded untouched while `body_modified` is False), so an upstream turn sends exactly
what the client sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from ..errors import bad_request
from .required import check_chat_message, check_input_item, missing


@dataclass(slots=True)
class ApiRequest:
    body: dict[str, Any]
    raw: bytes
    model: str
    stream: bool
    include_usage: bool
    turn: int  # the log line's turn: user messages before the last one (0 for a completion)
    body_modified: bool = False
    # How long the client asks for this session's KV to be kept (OpenAI's `prompt_cache_retention`,
    # Anthropic's `cache_control.ttl`), in seconds; None: no hint. The store's retention reads it.
    retention_hint_s: float | None = None

    def upstream_bytes(self) -> bytes:
        return orjson.dumps(self.body) if self.body_modified else self.raw


@dataclass(slots=True)
class ChatRequest(ApiRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionRequest(ApiRequest):
    # The one prompt served locally (text or token ids); None for a shape only an upstream serves (a
    # batch of several prompts).
    prompt: str | list[int] | None = None


@dataclass(slots=True)
class ResponsesRequest(ApiRequest):
    # The new input as chat messages (function calls and their outputs as tool calls and tool
    # messages); None when an item is of a kind only an upstream serves (images, item references,
    # reasoning): `unserved` says which.
    input_messages: list[dict[str, Any]] | None = None
    unserved: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    # `truncation: "auto"`: a conversation past the context loses its oldest turns (where the server's
    # truncate_on_overflow allows it); "disabled", OpenAI's default: it is a 400 instead.
    truncate: bool = False
    # Resolved by the route: the conversation (the previous response's, then the new input) and the
    # prompt's messages (the instructions first: they are not carried over from a previous response).
    conversation: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)

    def continue_from(self, history: list[dict[str, Any]]) -> None:
        """Resolve the conversation: `history` (a stored response's, or none), then the new input."""
        assert self.input_messages is not None
        self.conversation = [*history, *self.input_messages]
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        self.messages = [*system, *self.conversation]
        self.turn = count_turn(self.messages)


# OpenAI's `prompt_cache_retention` values as retention hints, in seconds. "in_memory": OpenAI keeps a
# cached prefix 5-10 minutes idle (up to an hour off-peak): 10 minutes. "24h": a day. Either is capped by
# attention_store.retention.max_hint_s where the store is asked (proxy/serving/retention.py).
PROMPT_CACHE_RETENTION_S = {"in_memory": 600.0, "24h": 86400.0}


def prompt_cache_key(body: dict[str, Any]) -> str | None:
    """OpenAI's `prompt_cache_key` (it stays in the body: it is OpenAI's field), validated: a string."""
    key = body.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise bad_request("'prompt_cache_key' must be a string.", param="prompt_cache_key")
    return key


def retention_hint(body: dict[str, Any]) -> float | None:
    """OpenAI's `prompt_cache_retention` as a hint in seconds (None: absent or null); anything but its
    two values is a 400 naming the param."""
    given = body.get("prompt_cache_retention")
    if given is None:
        return None
    hint = PROMPT_CACHE_RETENTION_S.get(given) if isinstance(given, str) else None
    if hint is None:
        allowed = ", ".join(repr(v) for v in PROMPT_CACHE_RETENTION_S)
        raise bad_request(
            f"'prompt_cache_retention' must be one of {allowed}.", param="prompt_cache_retention"
        )
    return hint


def count_turn(messages: list[dict[str, Any]]) -> int:
    """Turn index from 0: the number of user messages before the last one."""
    users = sum(1 for m in messages if m.get("role") == "user")
    return max(0, users - 1)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, else a 400 (every turn endpoint, whatever its API)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    return body


def _load_object(raw: bytes) -> dict[str, Any]:
    body = json_object(raw)
    if "model" not in body:
        raise missing("model")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string.", param="model")
    return body


def _common_fields(raw: bytes, body: dict[str, Any]) -> dict[str, Any]:
    """What a Chat Completions or Completions request carries besides its own fields: its body (raw and
    parsed), its model and its stream flags (validated)."""
    stream, include_usage = _stream_flags(body)
    return {
        "body": body,
        "raw": raw,
        "model": body["model"],
        "stream": stream,
        "include_usage": include_usage,
    }


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage), validated."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", param="stream_options")
    if options is not None and not stream:  # OpenAI's rule and its words
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
        )
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise bad_request("'n' must be a positive integer.", param="n")
    return bool(stream), bool(options and options.get("include_usage") is True)


def parse_chat(raw: bytes) -> ChatRequest:
    body = _load_object(raw)
    if "messages" not in body:
        raise missing("messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required and must be a non-empty array.", param="messages")
    for i, msg in enumerate(messages):
        check_chat_message(msg, i)
    prompt_cache_key(body)
    return ChatRequest(
        **_common_fields(raw, body),
        turn=count_turn(messages),
        messages=messages,
        retention_hint_s=retention_hint(body),
    )


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _one_prompt(prompt: object) -> str | list[int] | None:
    """The single prompt a batch-of-one or a plain prompt holds; None for a batch of several."""
    if isinstance(prompt, str) or (_is_token_ids(prompt) and prompt):
        return prompt  # type: ignore[return-value]
    if (
        isinstance(prompt, list)
        and len(prompt) == 1
        and (isinstance(prompt[0], str) or _is_token_ids(prompt[0]))
    ):
        return prompt[0]
    return None


def parse_completion(raw: bytes) -> CompletionRequest:
    body = _load_object(raw)
    if "prompt" not in body:
        raise missing("prompt")
    prompt = body.get("prompt")
    valid = (
        isinstance(prompt, str)
        or _is_token_ids(prompt)
        or (isinstance(prompt, list) and all(isinstance(p, str) or _is_token_ids(p) for p in prompt))
    )
    if prompt is None or not valid or prompt == []:
        raise bad_request(
            "'prompt' is required: a string, an array of strings, an array of token ids, or an array of "
            "token-id arrays.",
            param="prompt",
        )
    return CompletionRequest(**_common_fields(raw, body), turn=0, prompt=_one_prompt(prompt))


# Item content part types that carry text (the local engine serves these).
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text_of(content: str | list[dict[str, Any]], where: str) -> str:
    """A message's (or a tool output's) text parts joined, or NotServed naming the first other part."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part["type"] not in _TEXT_PARTS:
            raise _NotServed(f"{where}[{j}]: {part['type']!r} parts are not served locally")
        texts.append(part["text"])
    return "".join(texts)


class _NotServed(Exception):
    """An input item only an upstream serves (its reason is the message)."""


def _add_item(messages: list[dict[str, Any]], item: str | dict[str, Any], where: str) -> None:
    """A Responses input item (checked: required.check_input_item) appended as chat messages: a message
    as itself, a function call as an assistant's tool call (calls that follow an assistant message
    join it, as one chat turn holds its text and its parallel calls), a call's output as a tool
    message. Another kind raises _NotServed."""
    if isinstance(item, str):
        messages.append({"role": "user", "content": item})
        return
    kind = item.get("type", "message")
    if kind == "message":
        messages.append({"role": item["role"], "content": _text_of(item["content"], f"{where}.content")})
    elif kind == "function_call":
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = _text_of(item["output"], f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    else:
        raise _NotServed(f"{where}: input items of type {kind!r} are not served locally")


def parse_responses(raw: bytes) -> ResponsesRequest:
    body = _load_object(raw)
    given = body.get("input")
    if isinstance(given, str):
        items: list[Any] = [given]
    elif isinstance(given, list) and given:
        items = given
    else:
        raise bad_request("'input' is required: a string or a non-empty array of input items.", param="input")
    messages: list[dict[str, Any]] | None = []
    unserved = None
    for i, item in enumerate(items):
        check_input_item(item, i)
        if messages is None:
            continue  # only checked: the request goes upstream
        try:
            _add_item(messages, item, f"input[{i}]")
        except _NotServed as exc:
            messages, unserved = None, str(exc)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string.", param="instructions")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad_request("'previous_response_id' must be a non-empty string.", param="previous_response_id")
    store = body.get("store", True)
    if store is None:
        store = True
    if not isinstance(store, bool):
        raise bad_request("'store' must be a boolean.", param="store")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise bad_request("'truncation' must be 'auto' or 'disabled'.", param="truncation")
    prompt_cache_key(body)
    return ResponsesRequest(
        body=body,
        raw=raw,
        model=body["model"],
        stream=bool(stream),
        include_usage=True,  # a Responses stream always ends with the usage (response.completed)
        # The log's turn of the input alone; a local turn counts its whole conversation (continue_from).
        turn=count_turn(messages) if messages else 0,
        input_messages=messages,
        unserved=unserved,
        instructions=instructions,
        previous_response_id=previous,
        store=store,
        truncate=truncation == "auto",
        retention_hint_s=retention_hint(body),
    )
