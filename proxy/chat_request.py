"""Parse and validate a Chat Completions body (orjson); bad input is a 400 naming the param."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from .errors import bad_request


@dataclass(slots=True)
class ChatRequest:
    """A validated chat body. `body` is the dict forwarded or served (the proxy's own fields removed);
    `raw` is the original bytes, forwarded untouched while `body_modified` is False."""

    body: dict[str, Any]
    raw: bytes
    model: str
    messages: list[dict[str, Any]]
    stream: bool
    include_usage: bool
    turn: int
    body_modified: bool = False

    def upstream_bytes(self) -> bytes:
        return orjson.dumps(self.body) if self.body_modified else self.raw


def count_turn(messages: list[dict[str, Any]]) -> int:
    """Turn index from 0: the number of user messages before the last one."""
    users = sum(1 for m in messages if m.get("role") == "user")
    return max(0, users - 1)


def parse_chat(raw: bytes) -> ChatRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string.", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required and must be a non-empty array.", param="messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'.", param="messages")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", param="stream_options")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise bad_request("'n' must be a positive integer.", param="n")
    include_usage = bool(options and options.get("include_usage") is True)
    return ChatRequest(
        body=body,
        raw=raw,
        model=model,
        messages=messages,
        stream=bool(stream),
        include_usage=include_usage,
        turn=count_turn(messages),
    )
