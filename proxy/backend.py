"""The seam between the proxy and local serving.

The chat handler builds a `RequestContext`, asks `routing.choose_route`, and for a local route calls
`app[LOCAL_BACKEND].handle(request, chat, ctx)`. The backend sets the X-AttentionStore-* headers itself
with `proxy.headers.store_headers(...)` and logs its turn with `proxy.access_log.log_turn(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aiohttp import web

from .chat_request import ChatRequest


@dataclass(slots=True)
class RequestContext:
    received_at: float  # time.monotonic() when the request arrived (TTFT is measured from here)
    tenant: str  # short hash of the bearer key, or "anonymous"
    session: str  # resolved session id (body field, X-Session-Id, or prefix fingerprint)
    turn: int  # user messages before the last one


@runtime_checkable
class LocalBackend(Protocol):
    def supports(self, chat: ChatRequest) -> str | None:
        """None when this request can be served locally, else the reason it cannot (goes upstream)."""

    async def handle(
        self, request: web.Request, chat: ChatRequest, ctx: RequestContext
    ) -> web.StreamResponse:
        """Serve the request locally: set headers, stream or return the completion, log the turn."""
