"""The store's own endpoints: stats (JSON), Prometheus metrics, and forgetting a session."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from .keys import LOCAL_BACKEND, METRICS, SESSION_INDEX, SETTINGS
from .tenant import check_client_auth, tenant_of


def _sum_stats(per_model: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One store's shape, summed over the models (the common case is one model, where it is that store)."""
    total: dict[str, Any] = {}
    for stats in per_model.values():
        for key, value in stats.items():
            if isinstance(value, bool):
                total[key] = total.get(key, True) and value
            elif isinstance(value, int | float):
                total[key] = total.get(key, 0) + value
            elif isinstance(value, dict):
                total[key] = _sum_stats({"_": total.get(key, {}), "__": value})
    return total


def local_runner(app: web.Application) -> Any | None:
    """The local runner behind the app's backend, if it has one (a test's fake backend may not)."""
    return getattr(app[LOCAL_BACKEND], "runner", None)


def store_stats(app: web.Application) -> dict[str, dict[str, Any]]:
    stores = getattr(local_runner(app), "stores", {})
    return {name: store.stats().to_dict() for name, store in stores.items()}


async def stats(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    check_client_auth(request.headers, settings.proxy.api_keys)
    per_model = store_stats(request.app)
    runner = local_runner(request.app)
    body = {
        "enabled": settings.attention_store.enabled,
        **_sum_stats(per_model),
        "models": per_model,
        "runner": {"queued": runner.queue_depth, "running": runner.running, "cancelled": runner.cancelled}
        if runner
        else None,
        "session_index": request.app[SESSION_INDEX].describe(),
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def forget_session(request: web.Request) -> web.Response:
    """Drop the caller's session (this tenant only) from every tier and from the session index."""
    settings = request.app[SETTINGS]
    check_client_auth(request.headers, settings.proxy.api_keys)
    session = request.match_info["session_id"]
    tenant = tenant_of(request.headers)
    stores = getattr(local_runner(request.app), "stores", {})
    dropped = 0
    for store in stores.values():
        dropped += await asyncio.to_thread(store.forget_session, tenant, session)
    await request.app[SESSION_INDEX].forget(tenant, session)
    body = {"id": session, "object": "attention_store.session.deleted", "deleted": True, "chunks": dropped}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(request.app[METRICS].render)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
