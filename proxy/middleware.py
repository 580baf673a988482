"""Every error leaves as an OpenAI error object; client auth on everything but /healthz; nothing a client
sends is a 5xx; a body that arrives too slowly is a 408."""

from __future__ import annotations

import logging

from aiohttp import web

from .errors import APIError, error_response
from .keys import SETTINGS
from .tenant import check_client_auth

log = logging.getLogger("attnstore")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        if request.path != "/healthz":  # with keys set, every endpoint but /healthz needs one
            proxy = request.app[SETTINGS].proxy
            check_client_auth(request.headers, proxy.api_keys, proxy.admin_keys)
        return await handler(request)
    except APIError as exc:
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(APIError(413, f"Request body too large: {exc.text}", code="request_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        keep = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return error_response(APIError(exc.status, exc.reason, headers=keep))
    except (ConnectionResetError, TimeoutError) as exc:
        # The client went away mid-response; nobody is left to answer.
        log.debug("client connection lost: %s", exc)
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(APIError(500, "Internal error in the proxy.", type_="server_error"))
