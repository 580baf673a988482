"""Typed application keys: the app's only state (no process-global state beyond it)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from ..cluster.session_index import SessionIndex
from ..settings import Settings
from ..turns.backend import LocalBackend
from .metrics import Metrics

SETTINGS = web.AppKey("settings", Settings)
# One ClientSession for the app's life (created in a cleanup_ctx), used for every upstream call.
HTTP_CLIENT = web.AppKey("http_client", aiohttp.ClientSession)
# The one seam into local serving (built when the app starts, closed when it stops); None: all upstream.
LOCAL_BACKEND: web.AppKey[LocalBackend | None] = web.AppKey("local_backend")
# Prometheus registry of this app (no process-global metrics).
METRICS = web.AppKey("metrics", Metrics)
# Which replica/tier holds each session's KV: in memory, or Redis shared by replicas.
SESSION_INDEX: web.AppKey[SessionIndex] = web.AppKey("session_index")
