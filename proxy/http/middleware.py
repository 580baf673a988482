"""The one middleware: client auth (the only check, on everything but /healthz), every error as an OpenAI
error object (Anthropic's on its paths, /v1/messages*, so its SDK raises the right exception; nothing a
client sends is a 5xx), and every turn request (chat, completions, responses, messages) opened and
finished as a `Turn`, so its answer carries the X-AttentionStore-* headers and it logs one line, errors
included."""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from ..anthropic.messages import PATH_PREFIX as ANTHROPIC_PATH_PREFIX
from ..anthropic.messages import REQUEST_ID_HEADER, error_bytes, new_request_id
from ..errors import APIError, error_response
from ..metrics import METRICS
from ..settings import SETTINGS, replica_id
from ..turns.tenant import check_client_auth
from ..turns.turn import TURN, Turn

log = logging.getLogger("attnstore")

# The turn endpoints: served locally with reuse, or upstream, each request with its turn's headers.
TURN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
UNAUTHENTICATED_PATHS = frozenset({"/healthz"})


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path not in TURN_PATHS:
        return await _answer(request, handler)
    turn = Turn.open(request, replica=replica_id(request.app[SETTINGS]), metrics=request.app[METRICS])
    request[TURN] = turn
    try:
        return await _answer(request, handler, turn)
    finally:
        turn.finish()  # the one log line and observation, unless the route finished it already


async def _answer(request: web.Request, handler: Handler, turn: Turn | None = None) -> web.StreamResponse:
    """The handler's answer, or the error answer (tagged by the chat turn, when there is one)."""
    try:
        if request.path not in UNAUTHENTICATED_PATHS:
            proxy = request.app[SETTINGS].proxy
            check_client_auth(request.headers, proxy.api_keys, proxy.admin_keys)
        return await handler(request)
    except APIError as exc:
        error = exc
    except web.HTTPRequestEntityTooLarge as exc:
        error = APIError(413, f"Request body too large: {exc.text}", code="request_too_large")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        keep = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        error = APIError(exc.status, exc.reason, headers=keep)
    except ConnectionResetError as exc:
        # The client went away mid-response (a stream's last bytes included): nobody is left to answer.
        # Raised on, aiohttp would log it as an error with its traceback; answered, its own write to
        # the closed connection ends quietly (the connection is closed first, so nothing else is sent).
        log.debug("client connection lost: %s", exc)
        if request.transport is not None:
            request.transport.close()
        return web.Response(status=499, reason="Client Closed Request")
    except TimeoutError as exc:
        log.debug("timed out: %s", exc)
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        error = APIError(500, "Internal error in the proxy.", type_="server_error")
    response = _error_answer(request, error)
    if turn is not None:
        turn.tag(response)
    return response


def _error_answer(request: web.Request, error: APIError) -> web.Response:
    """The error in the shape of the API the path belongs to."""
    if not request.path.startswith(ANTHROPIC_PATH_PREFIX):
        return error_response(error)
    request_id = new_request_id()
    status, body = error_bytes(error, request_id)
    headers = {**(error.headers or {}), REQUEST_ID_HEADER: request_id}
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


async def name_anthropic_answers(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer on Anthropic's paths carries a `request-id` (the upstream's own where it sent one;
    an error's is already set, the same as its body's `request_id`)."""
    if request.path.startswith(ANTHROPIC_PATH_PREFIX) and REQUEST_ID_HEADER not in response.headers:
        response.headers[REQUEST_ID_HEADER] = new_request_id()
