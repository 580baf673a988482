"""Assemble the aiohttp application: settings, the shared HTTP client, middleware and routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from .backend import LocalBackend, RequestContext
from .chat_request import ChatRequest
from .errors import APIError
from .forwarding import install_forwarding
from .keys import HTTP_CLIENT, LOCAL_BACKEND, LOCAL_RUNNER, METRICS, SESSION_INDEX, SETTINGS
from .metrics import Metrics, RunnerCollector
from .middleware import error_middleware
from .routes_chat import chat_completions
from .routes_misc import healthz, list_models
from .routes_store import forget_session, metrics, stats, store_stats
from .server_log import install_bad_request_log
from .session_index import MemorySessionIndex, SessionIndex, open_session_index
from .settings import Settings
from .upstream import forward_chat

if TYPE_CHECKING:  # torch and transformers load only when the local runner is enabled
    from local_runner.loader import LoadedModel


async def _http_client(app: web.Application) -> AsyncIterator[None]:
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    # auto_decompress=False: answers go back byte for byte; skip_auto_headers: send only what the client sent.
    async with aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        # Never keep upstream cookies: one client's Set-Cookie must not ride along with another's request.
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("Accept-Encoding", "User-Agent", "Accept"),
    ) as session:
        app[HTTP_CLIENT] = session
        yield


async def _close_local(app: web.Application) -> None:
    """Stop the runner's worker and let pending L2 writes finish, so a restart finds every chunk."""
    runner = app[LOCAL_RUNNER]
    if runner is not None:
        await asyncio.to_thread(runner.close)
    pool = getattr(app[LOCAL_BACKEND], "tokenize_pool", None)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    await app[SESSION_INDEX].close()


def build_app(
    settings: Settings,
    *,
    local_backend: LocalBackend | None = None,
    index: SessionIndex | None = None,
) -> web.Application:
    install_bad_request_log()
    app = web.Application(
        client_max_size=int(settings.proxy.max_body_mb * 1024 * 1024),
        middlewares=[error_middleware],
        # An idle keep-alive connection, or one that never completes its request headers, is closed;
        # after an early answer (408, 413) the unread rest of a body is drained for 2 s at most, not 10.
        handler_args={"keepalive_timeout": settings.proxy.keepalive_timeout_s, "lingering_time": 2.0},
    )
    app[SETTINGS] = settings
    app[LOCAL_BACKEND] = local_backend
    app[LOCAL_RUNNER] = None
    app[SESSION_INDEX] = index or MemorySessionIndex()
    # Read at scrape time, on the thread that renders the metrics (never on the event loop).
    app[METRICS] = Metrics(lambda: store_stats(app[LOCAL_RUNNER]))
    app[METRICS].registry.register(RunnerCollector(lambda: r.stats() if (r := app[LOCAL_RUNNER]) else None))
    app.cleanup_ctx.append(_http_client)
    app.on_cleanup.append(_close_local)
    # With an advertise_url and a Redis index: the heartbeat, and turns forwarded to the replica holding
    # their KV. Otherwise nothing.
    install_forwarding(app, settings, app[SESSION_INDEX])
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/attention_store/stats", stats)
    app.router.add_delete("/v1/attention_store/sessions/{session_id}", forget_session)
    return app


def build_full_app(
    settings: Settings,
    *,
    models: Mapping[str, LoadedModel] | None = None,
    base_dir: Path | None = None,
) -> web.Application:
    """The proxy as `attnstore serve` runs it: the session index from settings and, when the local
    runner is enabled, its models (loaded here unless given), KV stores and backend."""
    app = build_app(settings, index=open_session_index(settings.proxy.session_index))
    if settings.local_runner.enabled:
        from .local.build import build_local_backend, load_models

        models = models if models is not None else load_models(settings, base_dir)
        backend = build_local_backend(
            settings, app[SESSION_INDEX], app[METRICS], models, overflow=_overflow, base_dir=base_dir
        )
        app[LOCAL_BACKEND] = backend
        app[LOCAL_RUNNER] = backend.runner
    return app


async def _overflow(request: web.Request, chat: ChatRequest, ctx: RequestContext) -> web.StreamResponse:
    """The local queue is full: the upstream takes the turn when it serves the same model."""
    settings = request.app[SETTINGS]
    if settings.llm_endpoint.base_url and settings.llm_endpoint.model == chat.model:
        return await forward_chat(request, chat, ctx, settings, request.app[HTTP_CLIENT])
    raise APIError(503, "The local queue is full; retry later.", code="queue_full")
