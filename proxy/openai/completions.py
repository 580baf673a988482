"""OpenAI (legacy) Completions wire objects for locally served turns: the `text_completion` answer and
its stream chunks (same object, text deltas, then the usage chunk when asked for, then [DONE])."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class TextCompletionIds:
    """What every chunk of one completion repeats."""

    model: str
    system_fingerprint: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        }


def choice(text: str, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}


def chunk(
    ids: TextCompletionIds,
    text: str | None,
    finish_reason: str | None = None,
    *,
    index: int = 0,
    include_usage: bool = False,
    usage: dict[str, Any] | None = None,
) -> bytes:
    """One SSE event; `text=None` makes the usage-only chunk (empty choices) that ends the stream when
    `stream_options.include_usage` is set (other chunks then carry `"usage": null`)."""
    body = ids.envelope([] if text is None else [choice(text, finish_reason, index)])
    if include_usage:
        body["usage"] = usage
    return b"data: " + orjson.dumps(body) + b"\n\n"
