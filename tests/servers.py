"""Test helpers: the threaded app server (tests.support.threaded_server) and a stdlib HTTP client."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import orjson

from tests.support.threaded_server import AppServer, serve_in_thread

__all__ = ["AppServer", "HTTPResult", "http_request", "serve_in_thread"]


@dataclass
class HTTPResult:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


def http_request(
    method: str,
    url: str,
    body: bytes | dict | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> HTTPResult:
    """A plain synchronous HTTP call (stdlib only) that returns error statuses instead of raising."""
    headers = dict(headers or {})
    if isinstance(body, dict):
        body = orjson.dumps(body)
        headers.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, hdrs, data = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        status, hdrs, data = err.code, err.headers, err.read()
    return HTTPResult(status, {k.lower(): v for k, v in hdrs.items()}, data)
