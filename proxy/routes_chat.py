"""POST /v1/chat/completions: parse, resolve tenant and session, route, then serve locally or upstream."""

from __future__ import annotations

import time

from aiohttp import web

from .access_log import log_turn
from .backend import RequestContext
from .chat_request import parse_chat
from .errors import APIError, error_response
from .forwarding import FORWARDER
from .headers import TTFT, store_headers
from .keys import HTTP_CLIENT, LOCAL_BACKEND, METRICS, SETTINGS
from .limits import read_body, refuse_oversized_local_body
from .middleware import ROUTE_KEY, SESSION_KEY
from .routing import choose_route
from .session import resolve_session
from .settings import replica_id
from .tenant import tenant_of
from .upstream import forward_chat


async def chat_completions(request: web.Request) -> web.StreamResponse:
    received_at = time.monotonic()
    settings = request.app[SETTINGS]
    refuse_oversized_local_body(request)
    raw = await read_body(request, settings.proxy.body_read_timeout_s)
    chat = parse_chat(raw)
    key = settings.attention_store.session_key
    chat.body_modified = key in chat.body
    session = resolve_session(chat.body, request.headers, key)
    request[SESSION_KEY] = session
    ctx = RequestContext(
        received_at=received_at,
        tenant=tenant_of(request.headers),
        session=session,
        turn=chat.turn,
    )
    backend = request.app[LOCAL_BACKEND]
    route = choose_route(settings, chat, backend)
    if route.kind == "local" and backend is not None:
        request[ROUTE_KEY] = "local"
        forwarder = request.app.get(FORWARDER)
        if forwarder is not None:  # another replica holds this session's KV in memory: its turn
            forwarded = await forwarder.try_forward(request, chat, ctx)
            if forwarded is not None:
                return forwarded
        return await backend.handle(request, chat, ctx)
    if route.kind == "upstream":
        response = await forward_chat(request, chat, ctx, settings, request.app[HTTP_CLIENT])
        ttft_ms = float(response.headers.get(TTFT, 0) or 0)
        request.app[METRICS].observe_turn(
            route="upstream", cache="bypass", reused=0, prompt=0, ttft_ms=ttft_ms
        )
        return response
    ttft_ms = (time.monotonic() - received_at) * 1000.0
    log_turn(session=session, turn=chat.turn, cache="bypass", reused=0, prompt=0, ttft_ms=ttft_ms)
    headers = store_headers(
        cache="bypass",
        route="upstream",
        reused=0,
        session=session,
        ttft_ms=ttft_ms,
        replica=replica_id(settings),
    )
    return error_response(
        APIError(400, f"Cannot serve this request: {route.reason}.", param="model"), headers
    )
