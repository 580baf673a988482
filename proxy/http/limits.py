"""Cheap limits that run before any expensive work: where the proxy may listen without client keys, how big
a body may be and how long it may take to arrive (read whole, or streamed on as it arrives), and whether a
prompt can possibly fit the model's context before it is tokenized.

The prompt bound. Tokenizing is the first expensive step of a local turn (a 10 MB body is ~30 s of CPU),
so a prompt that cannot fit is refused by counting characters first. A model's tokens decode to at most
`max_chars_per_token` characters each (the longest token of its vocabulary, measured once per model: 81
for SmolLM2), so text of more than `max_chars_per_token * limit` characters has more than `limit` tokens
and can never fit, and neither can more messages than `limit` (every message renders at least one
token). This bound never refuses a prompt that would fit; what it lets through, the tokenizer decides.
With `truncate_on_overflow`, the system messages and the last message are always kept, so only they
are held to the bound; older turns that certainly cannot fit are dropped before tokenizing, oldest
first (the runner's truncation then drops more by tokens where needed).
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .errors import APIError

_SYSTEM = ("system", "developer")


def chars_of(msg: Any) -> int:
    """Characters of a message's text (a string, or text parts); anything else counts as nothing here
    (the renderer refuses it)."""
    if not isinstance(msg, dict):
        return 0
    content = msg.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _too_long(model: str, limit: int, what: str) -> APIError:
    return APIError(
        400,
        f"the prompt cannot fit: {what}; {model} takes at most {limit} tokens here",
        param="messages",
        code="context_length_exceeded",
    )


def _role(msg: Any) -> Any:
    return msg.get("role") if isinstance(msg, dict) else None


def precheck_prompt(
    model: str,
    messages: Sequence[dict[str, Any]],
    *,
    limit: int,
    max_chars_per_token: int,
    truncate: bool,
) -> list[dict[str, Any]]:
    """The messages worth tokenizing, or a 400 `context_length_exceeded` when they certainly cannot fit
    in `limit` tokens (see the module's docstring for the bound). Linear in the number of messages."""
    max_chars = max_chars_per_token * limit
    msgs = list(messages)
    body, last = msgs[:-1], msgs[-1:]
    fixed_chars = sum(chars_of(m) for m in body if _role(m) in _SYSTEM) + sum(chars_of(m) for m in last)
    if fixed_chars > max_chars:
        raise _too_long(model, limit, f"its system and last messages have {fixed_chars} characters")
    total, count = fixed_chars, len(msgs)
    older = [i for i, m in enumerate(body) if _role(m) not in _SYSTEM]
    older_chars = [chars_of(body[i]) for i in older]
    total += sum(older_chars)
    if not truncate:
        if total > max_chars:
            raise _too_long(model, limit, f"its messages have {total} characters")
        if count > limit:
            raise _too_long(model, limit, f"it has {count} messages")
        return msgs
    # Drop the oldest turns that certainly cannot fit, then any assistant turns left at the head of
    # the history, which (as after the runner's truncation) starts with a user turn.
    j = 0
    while j < len(older) and (total > max_chars or count > limit):
        total, count, j = total - older_chars[j], count - 1, j + 1
    if j:
        while j < len(older) and _role(body[older[j]]) == "assistant":
            total, count, j = total - older_chars[j], count - 1, j + 1
    if count > limit:
        raise _too_long(model, limit, f"it has {count} system messages")
    if not j:
        return msgs
    dropped = set(older[:j])
    return [m for i, m in enumerate(body) if i not in dropped] + last


def max_chars_per_token(tokenizer: Any) -> int:
    """The most characters one token of this tokenizer's vocabulary decodes to (at least 1)."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(1, max((len(tokenizer.convert_tokens_to_string([t])) for t in vocab if t), default=1))


# Bytes of request body per token of context that a prompt that fits can need at most: generous for
# UTF-8 and JSON escapes (\uXXXX), since a token is a few characters; plus room for the rest of the body.
BODY_BYTES_PER_CONTEXT_TOKEN = 64
BODY_OVERHEAD_BYTES = 64 * 1024


def refuse_oversized_local_body(request: web.Request, context: int) -> None:
    """For a proxy without an upstream, which serves local models only: a body larger than any of their
    contexts (`context` tokens, the longest; 0: unknown) can hold, by Content-Length, is refused before a
    byte of it is read or parsed (413), so a client sending huge bodies costs the event loop no more than
    a small request does."""
    if request.content_length is None or context <= 0:
        return
    limit = context * BODY_BYTES_PER_CONTEXT_TOKEN + BODY_OVERHEAD_BYTES
    if request.content_length > limit:
        raise APIError(
            413,
            f"The request body ({request.content_length} bytes) is larger than any prompt the local models "
            f"can take ({context} tokens; at most {limit} bytes).",
            code="request_too_large",
            headers={"Connection": "close"},
        )


def _body_late(what: str) -> APIError:
    # Connection: close: the rest of the body is never read, so the connection cannot carry another request.
    return APIError(408, f"The request body {what}.", code="request_timeout", headers={"Connection": "close"})


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body (client_max_size applies: 413 via the error middleware), or a 408 when it does not
    arrive within `timeout_s`, e.g. a Content-Length larger than what the client sends."""
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise _body_late(f"did not arrive within {timeout_s:g} s") from None


def body_too_large(limit: int, size: int | None = None) -> APIError:
    """413 for a body past proxy.max_body_mb (`limit` bytes); `size`, when the client declared it."""
    declared = f" ({size} bytes)" if size is not None else ""
    return APIError(
        413,
        f"Request body too large{declared}: proxy.max_body_mb allows at most {limit} bytes.",
        code="request_too_large",
        headers={"Connection": "close"},
    )


class StreamedBody:
    """A request body passed on as it arrives, never held whole (a multi-megabyte upload reaches the
    upstream while the client still sends it), under the limits `read_body` applies to a body read
    whole: at most `limit` bytes (413, before a byte is read when Content-Length says so already) and
    no silence longer than `idle_s` (408); a client that goes away mid-body, or sends a malformed one,
    is a 400.

    Whoever consumes `chunks()` (aiohttp's client, writing it upstream) reports only that writing the
    body failed, so `error` keeps why, for the answer; `ended_at` is when its last byte arrived."""

    def __init__(self, request: web.Request, *, limit: int, idle_s: float) -> None:
        if request.content_length is not None and request.content_length > limit:
            raise body_too_large(limit, request.content_length)
        self._content = request.content
        self._limit = limit
        self._idle_s = idle_s
        self.error: APIError | None = None
        self.ended_at: float | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        received = 0
        while chunk := await self._next():
            received += len(chunk)
            if received > self._limit:
                raise self._stop(body_too_large(self._limit))
            yield chunk
        self.ended_at = time.monotonic()

    async def _next(self) -> bytes:
        try:
            return await asyncio.wait_for(self._content.readany(), self._idle_s)
        except asyncio.TimeoutError:
            raise self._stop(_body_late(f"stalled for more than {self._idle_s:g} s")) from None
        except (ConnectionError, HttpProcessingError):
            message = "The request body was cut short: the client went away or sent a malformed body."
            raise self._stop(APIError(400, message, code="incomplete_body")) from None

    def _stop(self, error: APIError) -> APIError:
        self.error = error
        return error


def is_loopback(host: str) -> bool:
    """Whether a listen address is loopback only ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def check_bind(host: str, api_keys: Sequence[str], allow_unauthenticated: bool) -> str | None:
    """Why the proxy must not start listening on `host`, or None."""
    if is_loopback(host) or api_keys or allow_unauthenticated:
        return None
    return (
        f"refusing to listen on {host} without client keys: set proxy.api_keys, listen on 127.0.0.1, "
        "or set proxy.allow_unauthenticated_public_bind to true"
    )
