"""OpenAI (legacy) Completions wire objects for locally served turns: the `text_completion` answer and
its stream chunks (same object, text deltas, then the usage chunk when asked for, then [DONE])."""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from .chat import CompletionIds


def text_completion_ids(model: str, system_fingerprint: str) -> CompletionIds:
    """What every chunk of one completion repeats (the same as a chat completion's, its id `cmpl-`)."""
    return CompletionIds(model, system_fingerprint, id=f"cmpl-{uuid.uuid4().hex[:24]}")


def envelope(ids: CompletionIds, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": ids.id,
        "object": "text_completion",
        "created": ids.created,
        "model": ids.model,
        "system_fingerprint": ids.system_fingerprint,
        "choices": choices,
    }


def choice(text: str, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}


def chunk(
    ids: CompletionIds,
    text: str | None,
    finish_reason: str | None = None,
    *,
    index: int = 0,
    include_usage: bool = False,
    usage: dict[str, Any] | None = None,
) -> bytes:
    """One SSE event; `text=None` makes the usage-only chunk (empty choices) that ends the stream when
    `stream_options.include_usage` is set (other chunks then carry `"usage": null`)."""
    body = envelope(ids, [] if text is None else [choice(text, finish_reason, index)])
    if include_usage:
        body["usage"] = usage
    return b"data: " + orjson.dumps(body) + b"\n\n"
