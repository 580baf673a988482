"""Forward a request to `llm_endpoint.base_url`: headers and body through, the answer back chunk by chunk.

Bytes are never re-encoded: the client session is created with auto_decompress=False, so a compressed
answer reaches the client exactly as the upstream sent it, Content-Encoding included.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Mapping

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from .access_log import log_turn
from .backend import RequestContext
from .chat_request import ChatRequest
from .errors import APIError, error_body, error_response
from .headers import TTFT, store_headers
from .session import SESSION_HEADER
from .settings import Settings, replica_id

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
    )
)
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", SESSION_HEADER.lower()}
_DROP_RESPONSE = HOP_BY_HOP | {"content-length", "date", "server"}


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


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    return {t.strip().lower() for t in headers.get("Connection", "").split(",") if t.strip()}


def request_headers(
    client_headers: Mapping[str, str], upstream_key: str | None, *, keep_client_key: bool = True
) -> CIMultiDict[str]:
    """The client's headers for the upstream. The upstream key, when configured, replaces the client's;
    a key that only authenticates the client to this proxy (`keep_client_key=False`) never leaves it."""
    drop = _DROP_REQUEST | _connection_tokens(client_headers)
    if not keep_client_key:
        drop = drop | {"authorization"}
    out: CIMultiDict[str] = CIMultiDict((k, v) for k, v in client_headers.items() if k.lower() not in drop)
    if upstream_key:
        out["Authorization"] = f"Bearer {upstream_key}"
    return out


def response_headers(upstream: Mapping[str, str]) -> CIMultiDict[str]:
    drop = _DROP_RESPONSE | _connection_tokens(upstream)
    return CIMultiDict((k, v) for k, v in upstream.items() if k.lower() not in drop)


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


async def forward_chat(
    request: web.Request,
    chat: ChatRequest,
    ctx: RequestContext,
    settings: Settings,
    http: aiohttp.ClientSession,
) -> web.StreamResponse:
    url = upstream_yarl(settings.llm_endpoint.base_url, request.raw_path)
    p = settings.proxy
    headers = request_headers(
        request.headers, settings.upstream_api_key, keep_client_key=not (p.api_keys or p.admin_keys)
    )
    headers.setdefault("Content-Type", "application/json")

    def tagged(ttft_ms: float) -> dict[str, str]:
        return store_headers(
            cache="bypass",
            route="upstream",
            reused=0,
            session=ctx.session,
            ttft_ms=ttft_ms,
            replica=replica_id(settings),
        )

    def elapsed_ms() -> float:
        return (time.monotonic() - ctx.received_at) * 1000.0

    # The first byte (headers and the first body chunk) must come within upstream_first_byte_timeout_s;
    # after it, each chunk within upstream_idle_timeout_s (and upstream_timeout_s, the socket's limit).
    first_byte_by = time.monotonic() + settings.proxy.upstream_first_byte_timeout_s
    idle_s = settings.proxy.upstream_idle_timeout_s

    def first_byte_left() -> float:
        return max(0.001, first_byte_by - time.monotonic())

    try:
        resp = await asyncio.wait_for(
            http.post(url, data=chat.upstream_bytes(), headers=headers, timeout=request_timeout(settings)),
            first_byte_left(),
        )
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
        return _failed(ctx, 504, "The upstream did not answer in time.", tagged(elapsed_ms()))
    except aiohttp.ClientError as exc:
        return _failed(ctx, 502, f"Cannot reach the upstream: {type(exc).__name__}.", tagged(elapsed_ms()))

    try:
        out_headers = response_headers(resp.headers)
        encoded = "Content-Encoding" in resp.headers
        is_sse = resp.content_type == "text/event-stream"
        if chat.stream and 200 <= resp.status < 300 and not is_sse:
            # An HTML page or a JSON body where a stream was asked for: never an empty stream.
            resp.close()
            return _failed(
                ctx,
                502,
                f"The upstream answered a streamed request with {resp.content_type!r}, "
                "not text/event-stream.",
                tagged(elapsed_ms()),
            )
        try:
            first = await asyncio.wait_for(resp.content.readany(), first_byte_left())
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            return _failed(ctx, 504, "The upstream did not answer in time.", tagged(elapsed_ms()))
        except aiohttp.ClientError as exc:
            return _failed(ctx, 502, f"The upstream failed: {type(exc).__name__}.", tagged(elapsed_ms()))
        ttft_ms = elapsed_ms()
        out_headers.update(tagged(ttft_ms))

        if not is_sse:
            chunks = [first]
            try:
                async for chunk in resp.content.iter_any():
                    chunks.append(chunk)
            except (asyncio.TimeoutError, aiohttp.ClientError):
                return _failed(ctx, 502, "The upstream's answer was cut short.", tagged(ttft_ms))
            body = b"".join(chunks)
            prompt = 0 if encoded or resp.status >= 400 else prompt_tokens_from_json(body)
            log_turn(
                session=ctx.session, turn=ctx.turn, cache="bypass", reused=0, prompt=prompt, ttft_ms=ttft_ms
            )
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
            # One line per request, also when the client or the upstream went away mid-stream.
            prompt = prompt_tokens_from_sse_tail(tail) if track else 0
            log_turn(
                session=ctx.session, turn=ctx.turn, cache="bypass", reused=0, prompt=prompt, ttft_ms=ttft_ms
            )
        await stream.write_eof()
        return stream
    except BaseException:
        # Client gone (write failed or handler cancelled) or anything else: drop the upstream connection
        # so the upstream stops generating for nobody.
        resp.close()
        raise
    finally:
        resp.release()


def _failed(ctx: RequestContext, status: int, message: str, headers: dict[str, str]) -> web.Response:
    ttft_ms = float(headers[TTFT])
    log_turn(session=ctx.session, turn=ctx.turn, cache="bypass", reused=0, prompt=0, ttft_ms=ttft_ms)
    return error_response(APIError(status, message), headers)
