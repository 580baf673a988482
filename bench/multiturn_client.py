"""The replay client: one streamed Chat Completions call, timed the way a user perceives it.

TTFT (client) runs from just before the request is sent to the first SSE chunk that carries a non-empty
content delta or a finish_reason (the opening chunk with `role` and empty content is not a token).
Total latency runs to `data: [DONE]`. The X-AttentionStore-* headers, when the target sends them, give
the server's own view: hit level, reused tokens, TTFT from request received to first token ready.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson


class ChatError(RuntimeError):
    """The target answered with an error status or an in-band error; the message says which."""


@dataclass
class ChatResult:
    text: str
    finish_reason: str | None
    ttft_client_ms: float
    total_ms: float
    cache: str | None  # X-AttentionStore-Cache, None when the target does not send it
    reused_tokens: int | None
    ttft_header_ms: float | None
    session: str | None
    prompt_tokens: int | None  # usage, when the final chunk carries it
    cached_tokens: int | None
    completion_tokens: int | None
    tiers: dict[str, int] | None = None  # X-AttentionStore-Tiers: reused tokens per tier


def _tiers(value: str | None) -> dict[str, int] | None:
    """`l0=512,l1=0,l2=256` -> {"l0": 512, "l1": 0, "l2": 256}; None when absent or malformed."""
    if not value:
        return None
    try:
        return {k: int(v) for k, v in (part.split("=", 1) for part in value.split(","))}
    except ValueError:
        return None


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def stream_chat(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    api_key: str = "bench",
    timeout_s: float = 900.0,
    headers: dict[str, str] | None = None,
) -> ChatResult:
    """POST `body` (forced to stream with usage) to `url` and read the whole stream; `headers` are sent
    besides the key (e.g. X-Session-Id, which any server may ignore where a body field could be refused)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    headers = {**(headers or {}), "Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    parts: list[str] = []
    finish: str | None = None
    usage: dict[str, Any] = {}
    first_at: float | None = None
    started = time.perf_counter()
    async with http.post(
        url, data=orjson.dumps(body), headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as resp:
        if resp.status != 200:
            raise ChatError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = orjson.loads(data)
            if "error" in chunk:
                raise ChatError(f"in-band error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    parts.append(content)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                if first_at is None and (content or choice.get("finish_reason")):
                    first_at = time.perf_counter()
        done = time.perf_counter()
        h = resp.headers
    details = usage.get("prompt_tokens_details") or {}
    return ChatResult(
        text="".join(parts),
        finish_reason=finish,
        ttft_client_ms=((first_at or done) - started) * 1000.0,
        total_ms=(done - started) * 1000.0,
        cache=h.get("X-AttentionStore-Cache"),
        reused_tokens=_int(h.get("X-AttentionStore-Reused-Tokens")),
        ttft_header_ms=_float(h.get("X-AttentionStore-TTFT-Ms")),
        session=h.get("X-AttentionStore-Session"),
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        tiers=_tiers(h.get("X-AttentionStore-Tiers")),
    )
