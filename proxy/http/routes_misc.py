"""GET /v1/models (local models merged with the upstream's list) and GET /healthz."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from ..settings import SETTINGS, replica_id
from ..turns.local_start import LOCAL_START
from ..upstream.forward import HTTP_CLIENT, upstream_url
from ..upstream.header_filter import outbound_headers

log = logging.getLogger("attnstore")


async def _upstream_models(request: web.Request) -> list[dict[str, Any]]:
    settings = request.app[SETTINGS]
    if not settings.llm_endpoint.base_url:
        return []
    url = upstream_url(settings.llm_endpoint.base_url, "/v1/models")
    headers = outbound_headers(request.headers, settings, "upstream", request.path)
    timeout = aiohttp.ClientTimeout(total=settings.proxy.models_timeout_s)
    try:
        async with request.app[HTTP_CLIENT].get(url, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                log.warning("upstream /v1/models answered %d; listing local models only", resp.status)
                return []
            doc = orjson.loads(await resp.read())
    except (asyncio.TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        log.warning("upstream /v1/models failed (%s); listing local models only", type(exc).__name__)
        return []
    data = doc.get("data") if isinstance(doc, dict) else None
    return (
        [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if isinstance(data, list)
        else []
    )


async def list_models(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    lr = settings.local_runner
    local = (
        [{"id": name, "object": "model", "created": 0, "owned_by": "attnstore"} for name in lr.models]
        if lr.enabled
        else []
    )
    seen = {m["id"] for m in local}
    merged = local + [m for m in await _upstream_models(request) if m["id"] not in seen]
    return web.Response(
        body=orjson.dumps({"object": "list", "data": merged}), content_type="application/json"
    )


async def healthz(request: web.Request) -> web.Response:
    """200 `ok` once local serving has started; 503 `starting` while it starts (the server listens from
    the first second: a balancer's check keeps turns away meanwhile) and `failed` when it could not."""
    settings = request.app[SETTINGS]
    start = request.app[LOCAL_START]
    backend = start.backend
    state = start.state
    status: dict[str, object] = {
        "status": "ok" if state == "ready" else state,
        "replica": replica_id(settings),
        "upstream": settings.llm_endpoint.base_url or None,
        "local_models": list(settings.local_runner.models) if settings.local_runner.enabled else [],
        "local_backend": backend is not None,
    }
    if start.failure is not None:
        status["error"] = start.failure
    if backend is not None:
        status["local"] = backend.engine.describe() if backend.engine is not None else {}
    return web.Response(
        status=200 if state == "ready" else 503, body=orjson.dumps(status), content_type="application/json"
    )
