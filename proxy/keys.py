"""Typed application keys shared by the proxy's modules (and the local backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from .backend import LocalBackend
from .metrics import Metrics
from .session_index import SessionIndex
from .settings import Settings

if TYPE_CHECKING:  # torch loads only when the local runner is enabled
    from local_runner.runner import Runner

SETTINGS = web.AppKey("settings", Settings)
# One ClientSession for the app's life (created in a cleanup_ctx), used for every upstream call.
HTTP_CLIENT = web.AppKey("http_client", aiohttp.ClientSession)
# None: everything goes upstream. Otherwise an object implementing proxy.backend.LocalBackend.
LOCAL_BACKEND: web.AppKey[LocalBackend | None] = web.AppKey("local_backend")
# The runner behind a local backend built from settings (its stats, forgetting, closing); None otherwise.
LOCAL_RUNNER: web.AppKey[Runner | None] = web.AppKey("local_runner")
# Prometheus registry of this app (no process-global metrics).
METRICS = web.AppKey("metrics", Metrics)
# Which replica/tier holds each session's KV: in memory, or Redis shared by replicas.
SESSION_INDEX: web.AppKey[SessionIndex] = web.AppKey("session_index")
