"""A client's request body passed on to the upstream as it arrives, under the limits a body read whole
is held to (size, silence)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..errors import APIError, body_late, body_too_large


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
            raise self._stop(body_late(f"stalled for more than {self._idle_s:g} s")) from None
        except (ConnectionError, HttpProcessingError):
            message = "The request body was cut short: the client went away or sent a malformed body."
            raise self._stop(APIError(400, message, code="incomplete_body")) from None

    def _stop(self, error: APIError) -> APIError:
        self.error = error
        return error
