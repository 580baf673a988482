"""The store's own endpoints: stats (JSON), Prometheus metrics, and forgetting a session."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from engine_api.engine import Engine
from engine_api.stats import EngineStats

from ..cluster.forwarding import FORWARDER
from ..cluster.session_index import SESSION_INDEX
from ..errors import APIError
from ..metrics import METRICS
from ..settings import SETTINGS
from ..turns.local_start import LOCAL_START, local_engine
from ..turns.tenant import is_admin, tenant_of


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


def _per_model(snapshot: EngineStats | None) -> dict[str, dict[str, Any]]:
    return {name: s.to_dict() for name, s in snapshot.stores.items()} if snapshot else {}


def stats_by_model(engine: Engine | None) -> dict[str, dict[str, Any]]:
    """Every model's store stats as JSON-able dicts. Blocking (it takes the stores' locks): call it off
    the event loop."""
    return _per_model(engine.stats() if engine else None)


def _admin(request: web.Request) -> bool:
    """Whether the caller (authenticated by the middleware already) sees every tenant."""
    proxy = request.app[SETTINGS].proxy
    return is_admin(request.headers, proxy.api_keys, proxy.admin_keys)


async def stats(request: web.Request) -> web.Response:
    """Every tenant's numbers for an admin key (or when no keys are configured: one user); a client
    key sees its own scope only: the store's counters are shared by every tenant, so they are not shown."""
    settings = request.app[SETTINGS]
    if not _admin(request):
        body = {
            "enabled": settings.attention_store.enabled,
            "scope": "tenant",
            "tenant": tenant_of(request.headers),
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")
    engine = local_engine(request.app)
    snapshot = await asyncio.to_thread(engine.stats) if engine else None
    per_model = _per_model(snapshot)
    body = {
        "enabled": settings.attention_store.enabled,
        "scope": "all",
        **_sum_stats(per_model),
        "models": per_model,
        "runner": {
            "queued": snapshot.queued,
            "running": snapshot.running,
            "cancelled": snapshot.cancelled,
            "shifted_turns": snapshot.shifted_turns,
            "shifted_tokens": snapshot.shifted_tokens,
            "admitted": snapshot.admitted,
            "queue_wait_seconds": round(snapshot.queue_wait_seconds, 6),
            "forked_tokens": snapshot.forked_tokens,
        }
        if snapshot
        else None,
        "session_index": request.app[SESSION_INDEX].describe(),
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def delete_session(request: web.Request) -> web.Response:
    """Drop the caller's session (this tenant only) from every tier and from the session index, on
    every replica: the others hold their own memory tiers (forwarding's `forget_elsewhere`)."""
    session = request.match_info["session_id"]
    tenant = tenant_of(request.headers)
    await request.app[LOCAL_START].wait()  # the session is forgotten in the tiers, L2 included
    engine = local_engine(request.app)
    index = request.app[SESSION_INDEX]
    known = await index.get(tenant, session) is not None
    dropped = await asyncio.to_thread(engine.forget_session, tenant, session) if engine else 0
    await index.forget(tenant, session)
    forwarder = request.app.get(FORWARDER)
    elsewhere, dropped_elsewhere = (
        await forwarder.forget_elsewhere(request, session) if forwarder is not None else (False, 0)
    )
    dropped += dropped_elsewhere
    # deleted: whether this tenant had anything under that session (an unknown one answers false).
    deleted = known or dropped > 0 or elsewhere
    body = {"id": session, "object": "attention_store.session.deleted", "deleted": deleted, "chunks": dropped}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text: every tenant's traffic, so with keys configured an admin key only."""
    if not _admin(request):
        raise APIError(403, "/metrics needs an admin key (proxy.admin_keys).", code="admin_key_required")
    body = await asyncio.to_thread(request.app[METRICS].render)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
