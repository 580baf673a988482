"""OpenAI Chat Completions wire objects for locally served turns (responses and SSE chunks)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class CompletionIds:
    """What every chunk of one completion repeats: its id, creation time, model and fingerprint."""

    model: str
    system_fingerprint: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    }


def choice(
    index: int, message: dict[str, Any], finish_reason: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(ids: CompletionIds, choices: list[dict[str, Any]], usage_: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": ids.id,
        "object": "chat.completion",
        "created": ids.created,
        "model": ids.model,
        "system_fingerprint": ids.system_fingerprint,
        "choices": choices,
        "usage": usage_,
    }


def chunk(
    ids: CompletionIds,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    *,
    index: int = 0,
    include_usage: bool = False,
    usage_: dict[str, Any] | None = None,
    logprobs_: dict[str, Any] | None = None,
) -> bytes:
    """One SSE event. `delta=None` makes the usage-only chunk (empty choices) that ends a stream
    when `stream_options.include_usage` is set; other chunks then carry `"usage": null`."""
    body: dict[str, Any] = {
        "id": ids.id,
        "object": "chat.completion.chunk",
        "created": ids.created,
        "model": ids.model,
        "system_fingerprint": ids.system_fingerprint,
        "choices": []
        if delta is None
        else [{"index": index, "delta": delta, "logprobs": logprobs_, "finish_reason": finish_reason}],
    }
    if include_usage:
        body["usage"] = usage_
    return b"data: " + orjson.dumps(body) + b"\n\n"


DONE = b"data: [DONE]\n\n"
