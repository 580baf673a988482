"""Anthropic Messages API shapes: the message object, its usage, its stream events (SSE with `event:`
lines), and its error object. Plain functions over dicts, as `proxy/openai/chat.py` is for chat.

Usage maps attnstore's reuse onto Anthropic's prompt caching (docs/api.md, "Anthropic Messages"):

    cache_read_input_tokens      prompt tokens whose KV was reused from the store (the turn's reused tokens)
    cache_creation_input_tokens  prompt tokens computed by this turn and stored for reuse (whole KV chunks)
    input_tokens                 the rest: computed and not stored (a trailing partial chunk; all of it
                                 when the store is off)

so input_tokens + cache_read + cache_creation is the prompt, as Anthropic's are.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from ..errors import APIError

# The paths of Anthropic's API: their errors are in its shape, keys go upstream in x-api-key.
PATH_PREFIX = "/v1/messages"

# HTTP status -> Anthropic's error type. Statuses Anthropic does not use keep theirs (405, 408, 502)
# with the type of their class; 503 (the local queue is full) is Anthropic's 529.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
OVERLOADED = 529


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


# Anthropic names every answer with a `request-id` header (and an error body's `request_id`): its SDKs
# read it into `_request_id` and `APIStatusError.request_id`, which users quote to find a request.
REQUEST_ID_HEADER = "request-id"


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CacheAccounting:
    """How much of a turn's prompt the store keeps: whole chunks of `chunk_tokens` of the sequence the
    engine computed (the prompt, then the answer but its last token), when the store is on (`stores`)."""

    chunk_tokens: int
    stores: bool

    def stored_prompt_tokens(self, prompt: int, completion: int | None) -> int:
        """Prompt tokens in stored chunks; `completion` None: before the answer (its chunks not known
        yet, only the prompt's whole ones count)."""
        if not self.stores or self.chunk_tokens <= 0:
            return 0
        fed = prompt if completion is None else prompt + max(0, completion - 1)
        return min(prompt, fed // self.chunk_tokens * self.chunk_tokens)

    def usage(
        self, prompt: int, reused: int, output: int, stored: int, *, hour: bool = False
    ) -> dict[str, Any]:
        """Anthropic's usage object. `hour`: the turn asked for a 1h cache (`cache_control.ttl`), so
        what it stored counts as written for an hour (`cache_creation`'s split), else for 5 minutes."""
        creation = max(0, stored - reused)
        return {
            "input_tokens": max(0, prompt - reused - creation),
            "output_tokens": output,
            "cache_read_input_tokens": reused,
            "cache_creation_input_tokens": creation,
            "cache_creation": {
                "ephemeral_5m_input_tokens": 0 if hour else creation,
                "ephemeral_1h_input_tokens": creation if hour else 0,
            },
            "service_tier": "standard",
        }


def message(
    msg_id: str,
    model: str,
    content: list[dict[str, Any]],
    usage: dict[str, Any],
    stop_reason: str | None = None,
    stop_sequence: str | None = None,
) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def tool_use_block(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def event(kind: str, **fields: Any) -> bytes:
    """One SSE event: its `event:` line, then its data (which names its type too)."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def error_object(status: int, message_text: str) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error as Anthropic answers it."""
    if status == 503:
        status = OVERLOADED
    kind = ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": message_text}}


def error_event(message_text: str, status: int = 500) -> bytes:
    """The error event of a stream that already began (Anthropic's `event: error`)."""
    _, body = error_object(status, message_text)
    return event("error", error=body["error"])


def error_bytes(exc: APIError, request_id: str) -> tuple[int, bytes]:
    status, body = error_object(exc.status, exc.message)
    return status, orjson.dumps({**body, "request_id": request_id})
