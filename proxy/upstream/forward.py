"""Every call to `llm_endpoint.base_url` made for a client: a chat turn (`forward_chat`) and any other
request of the API passed through as it came (`forward_upstream`). One core for both: headers through
`header_filter`, the body sent (or streamed up as it arrives), the answer back chunk by chunk, the same
timeouts and errors. A chat turn's outcome (headers, log line, metrics) is its `Turn`'s.

Bytes are never re-encoded: the client session is created with auto_decompress=False, so a compressed
answer reaches the client exactly as the upstream sent it, Content-Encoding included.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeAlias, TypeVar

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from ..errors import APIError, error_body
from ..metrics import METRICS
from ..openai.requests import ApiRequest
from ..settings import SETTINGS, Settings, replica_id
from ..turns.headers import REPLICA, ROUTE
from ..turns.turn import Turn
from .header_filter import inbound_headers, outbound_headers
from .streamed_body import StreamedBody

_T = TypeVar("_T")

# One ClientSession for the app's life (created in a cleanup_ctx), used for every upstream call and every
# turn forwarded to another replica.
HTTP_CLIENT = web.AppKey("http_client", aiohttp.ClientSession)


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


# Anthropic's usage splits the prompt in three: uncached, read from its cache, written to it.
_ANTHROPIC_INPUT = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def _usage_prompt_tokens(doc: object) -> int:
    """The prompt tokens an answer's usage reports: OpenAI's prompt_tokens, or Anthropic's three parts."""
    if isinstance(doc, dict):
        usage = doc.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            return usage["prompt_tokens"]
        if isinstance(usage, dict) and isinstance(usage.get("input_tokens"), int):
            return sum(n for k in _ANTHROPIC_INPUT if isinstance(n := usage.get(k), int))
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


async def upstream_fallback(request: web.Request, chat: ApiRequest, turn: Turn) -> web.StreamResponse:
    """The local queue is full: the upstream takes the turn when it serves the same model, else 503."""
    settings = request.app[SETTINGS]
    if settings.llm_endpoint.base_url and settings.llm_endpoint.model == chat.model:
        return await forward_chat(request, chat, turn)
    raise APIError(503, "The local queue is full; retry later.", code="queue_full")


async def forward_chat(request: web.Request, chat: ApiRequest, turn: Turn) -> web.StreamResponse:
    """A chat turn sent upstream: its body without the proxy's own fields; a streamed request must get
    a stream; its prompt tokens come from the answer's usage (a JSON answer's, or a stream's last usage
    chunk when the client asked for one)."""
    return await forward_upstream(
        request,
        body=chat.upstream_bytes(),
        turn=turn,
        expect_stream=chat.stream,
        track_usage=chat.include_usage or not chat.stream,
    )


def require_upstream(request: web.Request) -> None:
    """`llm_endpoint.base_url`, or a 400 naming it: a request attnstore does not serve itself has nowhere
    to go without one (a 404 would wrongly say the path does not exist)."""
    if not request.app[SETTINGS].llm_endpoint.base_url:
        raise APIError(
            400,
            f"{request.method} {request.path} is not served by attnstore itself and no upstream is "
            "configured: set llm_endpoint.base_url to pass it through.",
            code="upstream_not_configured",
        )


async def forward_upstream(
    request: web.Request,
    *,
    body: bytes | None,
    turn: Turn | None,
    expect_stream: bool = False,
    track_usage: bool = False,
) -> web.StreamResponse:
    """The request sent to `llm_endpoint.base_url` (same method, path and query, headers through the one
    filter) and the upstream's answer streamed back as it arrives, status and headers kept.

    `body`: None streams the client's body up as it arrives (an upload is never held whole; at most
    proxy.max_body_mb, else a 413); bytes (a JSON body) are sent as they are. `expect_stream`: the client
    asked for a stream, so a 2xx answer that is not text/event-stream is a 502, never an empty stream.
    `track_usage`: read `usage.prompt_tokens` for the turn, from a JSON answer or the tail of a stream.

    With a `turn`, the turn is served upstream, its headers go on the answer and it is finished with
    the prompt tokens seen; its answer, unless a stream, is held whole (a small JSON document: one cut
    short is a clean 502, not a truncated body). Without one (a pass-through), the answer carries
    `X-AttentionStore-Route: upstream` and `X-AttentionStore-Replica`, errors included, and is counted by
    path in `attnstore_passthrough_requests`. A failure before the answer began is an APIError (502,
    504), answered by the middleware; after it, the answer is cut (an SSE stream gets an error event
    first) and the connection closed."""
    if turn is not None:
        require_upstream(request)
        turn.serve_upstream()
        return await _relay(request, body, turn, expect_stream=expect_stream, track_usage=track_usage)
    settings = request.app[SETTINGS]
    route = {ROUTE: "upstream", REPLICA: replica_id(settings)}
    status: int | None = None
    try:
        require_upstream(request)
        answer = await _relay(request, body, route, expect_stream=expect_stream, track_usage=track_usage)
        status = answer.status
        return answer
    except APIError as exc:
        status = exc.status
        exc.headers = {**route, **(exc.headers or {})}
        raise
    finally:
        request.app[METRICS].count_passthrough(request.path, status)


@dataclass(slots=True)
class _FirstByteDeadline:
    """The upstream's first byte (its headers, then the first chunk of its body) is due within
    `within_s` of the request having been sent whole. A streamed upload takes as long as its client
    takes (its silences are bounded by body_read_timeout_s), so for one the clock starts at its last byte."""

    within_s: float
    upload: StreamedBody | None
    started_at: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        start = self.started_at
        if self.upload is not None:
            start = self.upload.ended_at if self.upload.ended_at is not None else time.monotonic()
        return start + self.within_s - time.monotonic()

    async def wait(self, aw: Awaitable[_T]) -> _T:
        """`aw`'s result, or asyncio.TimeoutError once the deadline has passed (then `aw` is cancelled)."""
        task = asyncio.ensure_future(aw)
        try:
            while (left := self.left()) > 0:
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    return task.result()
            raise asyncio.TimeoutError
        finally:
            task.cancel()  # nothing when it is done


def _upload(request: web.Request, body: bytes | None, settings: Settings) -> StreamedBody | None:
    """The client's body streamed as it arrives, when it is not given as bytes and there is one."""
    if body is not None or not request.body_exists:
        return None
    limit = int(settings.proxy.max_body_mb * 1024 * 1024)
    return StreamedBody(request, limit=limit, idle_s=settings.proxy.body_read_timeout_s)


def _request_headers(request: web.Request, body: bytes | None, settings: Settings) -> CIMultiDict[str]:
    headers = outbound_headers(request.headers, settings, "upstream", request.path)
    if body is not None:
        headers.setdefault("Content-Type", "application/json")
    elif request.content_length is not None:
        # A body streamed verbatim keeps the client's length: an upload sent with Content-Length goes
        # on with it rather than chunked, which some upstreams and the load balancers in front of them
        # refuse (411) or buffer whole. It stays true: the server hands on at most that many bytes, and
        # fewer end the upload with StreamedBody's error (the upstream's connection is dropped then).
        headers["Content-Length"] = str(request.content_length)
    return headers


def _failed(exc: BaseException, upload: StreamedBody | None, when: str) -> APIError:
    """What a failed call to the upstream is to the client: the upload's own error when the body was the
    cause (too large, too slow, cut short: the client's doing, a 4xx), else a 504 or a 502."""
    if upload is not None and upload.error is not None:
        return upload.error
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return APIError(504, "The upstream did not answer in time.")
    return APIError(502, f"The upstream failed {when}: {type(exc).__name__}.")


# Who an answer reports to: the chat turn, or a pass-through's fixed X-AttentionStore-* headers.
_Outcome: TypeAlias = "Turn | dict[str, str]"


def _answer_headers(outcome: _Outcome) -> dict[str, str]:
    """The X-AttentionStore-* headers at the answer's first byte: the turn's, or a pass-through's."""
    if isinstance(outcome, Turn):
        outcome.upstream_first_byte()
        return outcome.headers()
    return outcome


def _finish(outcome: _Outcome, prompt: int) -> None:
    if isinstance(outcome, Turn):
        outcome.finish(prompt=prompt)


async def _relay(
    request: web.Request,
    body: bytes | None,
    outcome: _Outcome,
    *,
    expect_stream: bool,
    track_usage: bool,
) -> web.StreamResponse:
    """The one streaming core of `forward_upstream`."""
    settings = request.app[SETTINGS]
    upload = _upload(request, body, settings)
    url = upstream_yarl(settings.llm_endpoint.base_url, request.raw_path)
    headers = _request_headers(request, body, settings)
    deadline = _FirstByteDeadline(settings.proxy.upstream_first_byte_timeout_s, upload)
    data = upload.chunks() if upload is not None else body
    try:
        resp = await deadline.wait(
            request.app[HTTP_CLIENT].request(
                request.method, url, data=data, headers=headers, timeout=request_timeout(settings)
            )
        )
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        raise _failed(exc, upload, "before answering") from None

    try:
        is_sse = resp.content_type == "text/event-stream"
        if expect_stream and 200 <= resp.status < 300 and not is_sse:
            # An HTML page or a JSON body where a stream was asked for: never an empty stream.
            raise APIError(
                502,
                f"The upstream answered a streamed request with {resp.content_type!r}, not text/event-stream.",
            )
        try:
            first = await deadline.wait(resp.content.readany())
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            raise _failed(exc, upload, "before its first byte") from None
        out_headers = inbound_headers(resp.headers)
        out_headers.update(_answer_headers(outcome))
        usage_readable = track_usage and "Content-Encoding" not in resp.headers and resp.status < 400
        if isinstance(outcome, Turn) and not is_sse:
            return await _whole_answer(resp, first, out_headers, outcome, usage_readable)
        return await _stream_back(request, resp, first, out_headers, outcome, is_sse, usage_readable)
    except BaseException:
        # An error answer, the client gone (write failed or handler cancelled) or anything else: drop the
        # upstream connection so the upstream stops working for nobody.
        resp.close()
        raise
    finally:
        resp.release()


async def _whole_answer(
    resp: aiohttp.ClientResponse,
    first: bytes,
    headers: CIMultiDict[str],
    turn: Turn,
    usage_readable: bool,
) -> web.Response:
    """A turn's JSON answer held whole, for its usage: one cut short is a 502, not a truncated document."""
    chunks = [first]
    try:
        async for chunk in resp.content.iter_any():
            chunks.append(chunk)
    except (asyncio.TimeoutError, aiohttp.ClientError):
        raise APIError(502, "The upstream's answer was cut short.") from None
    body = b"".join(chunks)
    turn.finish(prompt=prompt_tokens_from_json(body) if usage_readable else 0)
    return web.Response(status=resp.status, reason=resp.reason, body=body, headers=headers)


async def _stream_back(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    first: bytes,
    headers: CIMultiDict[str],
    outcome: _Outcome,
    is_sse: bool,
    usage_readable: bool,
) -> web.StreamResponse:
    """The answer written to the client chunk by chunk as the upstream sends it (SSE, JSON, audio, ...);
    each chunk due within upstream_idle_timeout_s. A stream's usage is read from its tail."""
    stream = web.StreamResponse(status=resp.status, reason=resp.reason, headers=headers)
    track = is_sse and usage_readable
    tail = first if track else b""
    idle_s = request.app[SETTINGS].proxy.upstream_idle_timeout_s
    try:
        await stream.prepare(request)
        if first:
            await stream.write(first)
        while chunk := await asyncio.wait_for(resp.content.readany(), idle_s):
            await stream.write(chunk)
            if track:
                tail = tail[-4096:] + chunk
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        await _cut(request, resp, stream, is_sse, timed_out=isinstance(exc, asyncio.TimeoutError))
        return stream
    finally:
        # Its usage, when the stream carried it, also when the client or the upstream went away.
        _finish(outcome, prompt_tokens_from_sse_tail(tail) if track else 0)
    await stream.write_eof()
    return stream


async def _cut(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    stream: web.StreamResponse,
    is_sse: bool,
    timed_out: bool,
) -> None:
    """The upstream (or the client) failed after the headers went out: an SSE stream gets an error event
    saying why, then the answer is left unfinished (no [DONE], no last chunk, the connection closed),
    the signal a client cannot miss; the upstream's connection is dropped."""
    if is_sse:
        message = "The upstream went silent mid-stream." if timed_out else "The upstream failed mid-stream."
        event = error_body(message, "upstream_timeout" if timed_out else "upstream_error")
        with contextlib.suppress(Exception):
            await stream.write(b"data: " + event + b"\n\n")
    resp.close()
    if request.transport is not None:
        request.transport.close()
