"""Every error leaves as an OpenAI error object; client auth on everything but /healthz; nothing a client
sends is a 5xx; a body that arrives too slowly is a 408."""

from __future__ import annotations

import logging
import time

from aiohttp import web

from .errors import APIError, error_response
from .headers import store_headers
from .keys import SETTINGS
from .settings import replica_id
from .tenant import check_client_auth

log = logging.getLogger("attnstore")


CHAT_PATH = "/v1/chat/completions"
# Set by the chat handler as it learns them, so an error answer can carry the X-AttentionStore-* headers.
ROUTE_KEY = web.RequestKey("attnstore_route", str)
SESSION_KEY = web.RequestKey("attnstore_session", str)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    received_at = time.monotonic()
    try:
        return await _handle(request, handler)
    except _Answered as answered:
        if request.path == CHAT_PATH:
            _tag_chat_error(request, answered.response, received_at)
        return answered.response


class _Answered(Exception):
    """An error answer built from an exception (so the chat path can tag it before it leaves)."""

    def __init__(self, response: web.Response) -> None:
        self.response = response


async def _handle(request: web.Request, handler) -> web.StreamResponse:
    try:
        if request.path != "/healthz":  # with keys set, every endpoint but /healthz needs one
            proxy = request.app[SETTINGS].proxy
            check_client_auth(request.headers, proxy.api_keys, proxy.admin_keys)
        return await handler(request)
    except APIError as exc:
        raise _Answered(error_response(exc)) from None
    except web.HTTPRequestEntityTooLarge as exc:
        too_large = APIError(413, f"Request body too large: {exc.text}", code="request_too_large")
        raise _Answered(error_response(too_large)) from None
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        keep = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        raise _Answered(error_response(APIError(exc.status, exc.reason, headers=keep))) from None
    except (ConnectionResetError, TimeoutError) as exc:
        # The client went away mid-response; nobody is left to answer.
        log.debug("client connection lost: %s", exc)
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        raise _Answered(
            error_response(APIError(500, "Internal error in the proxy.", type_="server_error"))
        ) from None


def _tag_chat_error(request: web.Request, response: web.Response, received_at: float) -> None:
    """Every answer of the chat endpoint carries the X-AttentionStore-* headers, errors included: a local
    turn that failed is a `miss` on route `local`; one refused before routing, or upstream, a `bypass`."""
    route = request.get(ROUTE_KEY, "upstream")
    tags = store_headers(
        cache="miss" if route == "local" else "bypass",
        route=route,
        reused=0,
        session=request.get(SESSION_KEY) or request.headers.get("X-Session-Id", "") or "",
        ttft_ms=(time.monotonic() - received_at) * 1000.0,
        replica=replica_id(request.app[SETTINGS]),
    )
    for name, value in tags.items():
        response.headers.setdefault(name, value)
