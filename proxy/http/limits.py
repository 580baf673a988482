"""Cheap limits that run before any expensive work: where the proxy may listen without client keys, and
how big a request body may be and how long it may take to arrive (read whole here; streamed on as it
arrives: upstream/streamed_body.py). Whether a prompt can fit before it is tokenized is the serving
layer's (serving/prompt_bound.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Sequence

from aiohttp import web

from ..errors import APIError, body_late

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


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body (client_max_size applies: 413 via the error middleware), or a 408 when it does not
    arrive within `timeout_s`, e.g. a Content-Length larger than what the client sends."""
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise body_late(f"did not arrive within {timeout_s:g} s") from None


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
