"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}`, raised by every layer of
the proxy (`APIError`) and answered by the one middleware; and the errors more than one layer raises."""

from __future__ import annotations

import orjson
from aiohttp import web

# OpenAI's `type` per status, as its API answers them (an unknown key: 401 invalid_request_error with
# code invalid_api_key; an unknown URL or model: 404 invalid_request_error; a rate limit: 429 type
# "requests", code rate_limit_exceeded; an overload: 503 server_error). The upstream's failures have no
# OpenAI counterpart: their types name them.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "requests",
    502: "upstream_error",
    503: "server_error",
    504: "upstream_timeout",
}


class APIError(Exception):
    """Raised anywhere in a handler; the error middleware turns it into an OpenAI error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def body_too_large(limit: int, size: int | None = None) -> APIError:
    """413 for a body past proxy.max_body_mb (`limit` bytes); `size`, when the client declared it."""
    declared = f" ({size} bytes)" if size is not None else ""
    return APIError(
        413,
        f"Request body too large{declared}: proxy.max_body_mb allows at most {limit} bytes.",
        code="request_too_large",
        headers={"Connection": "close"},
    )


def body_late(what: str) -> APIError:
    """408 for a request body that did not arrive in time (`what` says how)."""
    # Connection: close: the rest of the body is never read, so the connection cannot carry another request.
    return APIError(408, f"The request body {what}.", code="request_timeout", headers={"Connection": "close"})


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_response(exc: APIError, headers: dict[str, str] | None = None) -> web.Response:
    merged = {**(exc.headers or {}), **(headers or {})}
    return web.Response(
        status=exc.status,
        body=error_body(exc.message, exc.type, exc.param, exc.code),
        content_type="application/json",
        headers=merged,
    )
