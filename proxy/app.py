"""Assemble the aiohttp application: settings, the shared HTTP client, middleware and routes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from .backend import LocalBackend
from .keys import HTTP_CLIENT, LOCAL_BACKEND, SETTINGS
from .middleware import error_middleware
from .routes_chat import chat_completions
from .routes_misc import healthz, list_models
from .settings import Settings


async def _http_client(app: web.Application) -> AsyncIterator[None]:
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    # auto_decompress=False: answers go back byte for byte; skip_auto_headers: send only what the client sent.
    async with aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent", "Accept"),
    ) as session:
        app[HTTP_CLIENT] = session
        yield


def build_app(settings: Settings, *, local_backend: LocalBackend | None = None) -> web.Application:
    app = web.Application(
        client_max_size=int(settings.proxy.max_body_mb * 1024 * 1024),
        middlewares=[error_middleware],
    )
    app[SETTINGS] = settings
    app[LOCAL_BACKEND] = local_backend
    app.cleanup_ctx.append(_http_client)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    return app
