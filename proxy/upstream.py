"""Forward a chat turn to `llm_endpoint.base_url`: headers (through `header_filter`) and body, the answer
back chunk by chunk. The turn's outcome (headers, log line, metrics) is the `Turn`'s.

Bytes are never re-encoded: the client session is created with auto_decompress=False, so a compressed
answer reaches the client exactly as the upstream sent it, Content-Encoding included.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from .chat_request import ChatRequest
from .errors import APIError, error_body
from .header_filter import inbound_headers, outbound_headers
from .keys import HTTP_CLIENT, SETTINGS
from .settings import Settings
from .turn import Turn


@functools.lru_cache(maxsize=256)
def upstream_yarl(base_url: str, path: str) -> URL:
    """`upstream_url` parsed once per distinct (base, path): URL parsing is a visible share of a hop."""
    return URL(upstream_url(base_url, path), encoded=True)


def upstream_url(base_url: str, path: str) -> str:
    """`{base_url}{path}`, without doubling "/v1" (OpenAI-style base URLs already end in /v1)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and (path == "/v1" or path.startswith("/v1/")):
        path = path[3:]
    return base + path


def request_timeout(settings: Settings) -> aiohttp.ClientTimeout:
    # No total limit (a long generation is fine); the limit is on silence: waiting for the upstream's
    # headers or its next bytes longer than upstream_timeout_s is a timeout.
    p = settings.proxy
    return aiohttp.ClientTimeout(
        total=None, sock_connect=p.upstream_connect_timeout_s, sock_read=p.upstream_timeout_s
    )


def _usage_prompt_tokens(doc: object) -> int:
    if isinstance(doc, dict):
        usage = doc.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            return usage["prompt_tokens"]
    return 0


def prompt_tokens_from_json(body: bytes) -> int:
    try:
        return _usage_prompt_tokens(orjson.loads(body))
    except orjson.JSONDecodeError:
        return 0


def prompt_tokens_from_sse_tail(tail: bytes) -> int:
    """The usage chunk is the last `data: {...}` before `data: [DONE]`; look for it in the stream's tail."""
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                n = _usage_prompt_tokens(orjson.loads(line[5:]))
            except orjson.JSONDecodeError:
                continue
            if n:
                return n
    return 0


async def upstream_fallback(request: web.Request, chat: ChatRequest, turn: Turn) -> web.StreamResponse:
    """The local queue is full: the upstream takes the turn when it serves the same model, else 503."""
    settings = request.app[SETTINGS]
    if settings.llm_endpoint.base_url and settings.llm_endpoint.model == chat.model:
        return await forward_chat(request, chat, turn)
    raise APIError(503, "The local queue is full; retry later.", code="queue_full")


async def forward_chat(request: web.Request, chat: ChatRequest, turn: Turn) -> web.StreamResponse:
    """The upstream's answer, streamed through as it arrives. A failure before the answer began is an
    APIError (502, 504: the middleware answers it); after, the stream ends with an error event."""
    settings = request.app[SETTINGS]
    turn.serve_upstream()
    url = upstream_yarl(settings.llm_endpoint.base_url, request.raw_path)
    headers = outbound_headers(request.headers, settings, "upstream")
    headers.setdefault("Content-Type", "application/json")

    # The first byte (headers and the first body chunk) must come within upstream_first_byte_timeout_s;
    # after it, each chunk within upstream_idle_timeout_s (and upstream_timeout_s, the socket's limit).
    first_byte_by = time.monotonic() + settings.proxy.upstream_first_byte_timeout_s
    idle_s = settings.proxy.upstream_idle_timeout_s

    def first_byte_left() -> float:
        return max(0.001, first_byte_by - time.monotonic())

    try:
        resp = await asyncio.wait_for(
            request.app[HTTP_CLIENT].post(
                url, data=chat.upstream_bytes(), headers=headers, timeout=request_timeout(settings)
            ),
            first_byte_left(),
        )
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
        raise APIError(504, "The upstream did not answer in time.") from None
    except aiohttp.ClientError as exc:
        raise APIError(502, f"Cannot reach the upstream: {type(exc).__name__}.") from None

    try:
        out_headers = inbound_headers(resp.headers)
        encoded = "Content-Encoding" in resp.headers
        is_sse = resp.content_type == "text/event-stream"
        if chat.stream and 200 <= resp.status < 300 and not is_sse:
            # An HTML page or a JSON body where a stream was asked for: never an empty stream.
            raise APIError(
                502,
                f"The upstream answered a streamed request with {resp.content_type!r}, not text/event-stream.",
            )
        try:
            first = await asyncio.wait_for(resp.content.readany(), first_byte_left())
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            raise APIError(504, "The upstream did not answer in time.") from None
        except aiohttp.ClientError as exc:
            raise APIError(502, f"The upstream failed: {type(exc).__name__}.") from None
        turn.upstream_first_byte()
        out_headers.update(turn.headers())

        if not is_sse:
            chunks = [first]
            try:
                async for chunk in resp.content.iter_any():
                    chunks.append(chunk)
            except (asyncio.TimeoutError, aiohttp.ClientError):
                raise APIError(502, "The upstream's answer was cut short.") from None
            body = b"".join(chunks)
            turn.finish(prompt=0 if encoded or resp.status >= 400 else prompt_tokens_from_json(body))
            return web.Response(status=resp.status, reason=resp.reason, body=body, headers=out_headers)

        stream = web.StreamResponse(status=resp.status, reason=resp.reason, headers=out_headers)
        track = chat.include_usage and not encoded
        tail = first if track else b""
        try:
            await stream.prepare(request)
            if first:
                await stream.write(first)
            while True:
                chunk = await asyncio.wait_for(resp.content.readany(), idle_s)
                if not chunk:
                    break
                await stream.write(chunk)
                if track:
                    tail = tail[-4096:] + chunk
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            # Headers are gone already: an SSE error event says why, then an unfinished stream (no
            # [DONE], the connection closed) is the signal a client cannot miss.
            timed_out = isinstance(exc, asyncio.TimeoutError)
            message = (
                "The upstream went silent mid-stream." if timed_out else "The upstream failed mid-stream."
            )
            with contextlib.suppress(Exception):
                await stream.write(
                    b"data: "
                    + error_body(message, "upstream_timeout" if timed_out else "upstream_error")
                    + b"\n\n"
                )
            resp.close()
            if request.transport is not None:
                request.transport.close()
            return stream
        finally:
            # Its usage, when the stream carried it, also when the client or the upstream went away.
            turn.finish(prompt=prompt_tokens_from_sse_tail(tail) if track else 0)
        await stream.write_eof()
        return stream
    except BaseException:
        # An error answer, the client gone (write failed or handler cancelled) or anything else: drop the
        # upstream connection so the upstream stops generating for nobody.
        resp.close()
        raise
    finally:
        resp.release()
