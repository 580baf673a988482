"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import orjson
from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "server_overloaded",
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
