"""POST /v1/chat/completions: parse, resolve tenant and session, route, then serve locally or upstream.

The request's `Turn` (opened by the middleware) learns who is asking and where the turn goes; whoever
serves it reports the rest to it, and an error raised anywhere is answered and finished by the middleware.
"""

from __future__ import annotations

from aiohttp import web

from .chat_request import parse_chat
from .errors import APIError
from .forwarding import FORWARDER
from .keys import LOCAL_BACKEND, SETTINGS
from .limits import read_body, refuse_oversized_local_body
from .routing import choose_route
from .session import resolve_session
from .tenant import tenant_of
from .turn import TURN
from .upstream import forward_chat


async def chat_completions(request: web.Request) -> web.StreamResponse:
    turn = request[TURN]
    settings = request.app[SETTINGS]
    backend = request.app[LOCAL_BACKEND]
    if backend is not None and not settings.llm_endpoint.base_url:
        # Local models only: a body larger than any of their contexts is refused before it is read.
        refuse_oversized_local_body(request, backend.max_context_tokens())
    raw = await read_body(request, settings.proxy.body_read_timeout_s)
    chat = parse_chat(raw)
    key = settings.attention_store.session_key
    chat.body_modified = key in chat.body
    session = resolve_session(chat.body, request.headers, key)
    turn.identify(session=session, tenant=tenant_of(request.headers), turn=chat.turn)
    route = choose_route(settings, chat, backend)
    if route.kind == "local" and backend is not None:
        turn.serve_locally()
        forwarder = request.app.get(FORWARDER)
        if forwarder is not None:  # another replica holds this session's KV in memory: its turn
            forwarded = await forwarder.try_forward(request, chat, turn)
            if forwarded is not None:
                return forwarded
        return await backend.handle(request, chat, turn)
    if route.kind == "upstream":
        return await forward_chat(request, chat, turn)
    raise APIError(400, f"Cannot serve this request: {route.reason}.", param="model")
