"""Assemble the aiohttp application: settings, the app's resources (each opened and closed in a
cleanup_ctx), the middleware and the routes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from ..cluster.forwarding import install_forwarding
from ..cluster.session_index import SESSION_INDEX, MemorySessionIndex, SessionIndex, open_session_index
from ..metrics import METRICS, EngineCollector, Metrics
from ..settings import SETTINGS, Settings, make_l2_folder
from ..turns.backend import LocalBackend
from ..turns.local_start import LOCAL_START, LocalBuilder, LocalStart, local_engine
from ..upstream.forward import HTTP_CLIENT, upstream_fallback
from .middleware import error_middleware, name_anthropic_answers
from .routes_misc import healthz, list_models
from .routes_passthrough import PASSTHROUGH_PATH, pass_through
from .routes_store import delete_session, metrics, stats, stats_by_model
from .routes_turns import (
    chat_completions,
    completions,
    count_input_tokens,
    count_tokens,
    create_response,
    delete_response,
    get_response,
    list_input_items,
    messages,
)
from .server_log import install_bad_request_log

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


async def _session_index(app: web.Application) -> AsyncIterator[None]:
    """Closed after local serving (which records into it) and the heartbeat (which withdraws from it)."""
    try:
        yield
    finally:
        await app[SESSION_INDEX].close()


async def _local_serving(app: web.Application) -> AsyncIterator[None]:
    """The one seam into local serving: its start begins as the app starts and ends after it listens
    (`LocalStart`); when the app stops, closed off the loop: the runner's worker, the stores' pending L2
    writes (finished, so a restart finds every chunk), the tokenize pool."""
    start = app[LOCAL_START]
    start.begin()
    try:
        yield
    finally:
        await start.close()


def build_app(
    settings: Settings,
    *,
    local: LocalBuilder | None = None,
    index: SessionIndex | None = None,
    local_models: Collection[str] | None = None,
) -> web.Application:
    """The proxy with `local` (called off the loop once the app starts) as its local backend, or none:
    all upstream. A turn for one of `local_models` (None: any turn) waits for it to start."""
    install_bad_request_log()
    app = web.Application(
        client_max_size=int(settings.proxy.max_body_mb * 1024 * 1024),
        middlewares=[error_middleware],
        # An idle keep-alive connection, or one that never completes its request headers, is closed;
        # after an early answer (408, 413) the unread rest of a body is drained for 2 s at most, not 10.
        handler_args={"keepalive_timeout": settings.proxy.keepalive_timeout_s, "lingering_time": 2.0},
    )
    app.on_response_prepare.append(name_anthropic_answers)
    app[SETTINGS] = settings
    app[LOCAL_START] = LocalStart(local, local_models)
    app[SESSION_INDEX] = index or MemorySessionIndex()
    # Read at scrape time, on the thread that renders the metrics (never on the event loop).
    app[METRICS] = Metrics(lambda: stats_by_model(local_engine(app)))
    app[METRICS].registry.register(EngineCollector(lambda: e.stats() if (e := local_engine(app)) else None))
    app.cleanup_ctx.append(_http_client)
    app.cleanup_ctx.append(_session_index)
    app.cleanup_ctx.append(_local_serving)
    # With an advertise_url and a Redis index: the heartbeat, and turns forwarded to the replica holding
    # their KV. Otherwise nothing.
    install_forwarding(app, settings, app[SESSION_INDEX])
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_post("/v1/responses/input_tokens", count_input_tokens)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/attention_store/stats", stats)
    app.router.add_delete("/v1/attention_store/sessions/{session_id}", delete_session)
    # Last: whatever the routes above do not serve goes upstream as it came.
    app.router.add_route("*", PASSTHROUGH_PATH, pass_through)
    return app


def build_full_app(
    settings: Settings,
    *,
    models: Mapping[str, LoadedModel] | None = None,
    base_dir: Path | None = None,
) -> web.Application:
    """The proxy as `attnstore serve` runs it: the session index from settings and, when the local
    runner is enabled, its models served by a backend built once the app listens (`LocalStart`: the
    models loaded then, unless given; every vLLM server started then). The L2 folder is made first
    (SettingsError when it cannot be)."""
    make_l2_folder(settings, base_dir or Path.cwd())
    index = open_session_index(settings.proxy.session_index)
    if not settings.local_runner.enabled:
        return build_app(settings, index=index)
    if settings.local_runner.engine == "vllm":  # a vLLM server per model, started (and waited for) then

        def vllm() -> LocalBackend:
            from ..local_vllm.build import build_vllm_backend

            return build_vllm_backend(settings, index, overflow=upstream_fallback, base_dir=base_dir)

        return build_app(settings, local=vllm, index=index, local_models=settings.local_runner.models)

    def local() -> LocalBackend:
        from ..local.build import build_cpu_kernels_meanwhile, build_local_backend, load_models

        if models is None:
            build_cpu_kernels_meanwhile(settings, base_dir)
        loaded = models if models is not None else load_models(settings, base_dir)
        return build_local_backend(settings, index, loaded, overflow=upstream_fallback, base_dir=base_dir)

    served = models.keys() if models is not None else settings.local_runner.models
    return build_app(settings, local=local, index=index, local_models=served)
