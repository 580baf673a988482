"""The local backend's start, and its one owner: `LocalStart`, held under the app key `LOCAL_START`.

Building local serving takes from a second to minutes: a GGUF's conversion and the exact kernel's build
on a machine's first start (docs/benchmarks.md, "What a start costs"), a vLLM server's start. The server listens before
that, so that a client's first try is never refused a connection: while the start runs, `/healthz`
answers 503 `starting` (a balancer sends nothing here yet), pass-through and upstream turns are served,
and a turn for a local model waits for the start to end (it takes its place then, under admission's
rules), counted in its TTFT. A start that fails answers the turns that waited with 503 and the reason,
and calls `on_failure` (`attnstore serve` stops and exits 1 with the reason).

The build runs on a thread of its own, a daemon: nothing waits for it at exit (`attnstore serve` stopped
during the start exits at once; a conversion writes its folder whole, renamed into place, so nothing
half-written is left to reuse). Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection

from aiohttp import web

from engine_api.engine import Engine
from engine_api.model_source import ModelLoadError

from ..errors import APIError
from .backend import LocalBackend

log = logging.getLogger("attnstore")

# Builds the local backend (slow, blocking: off the event loop); None: no local serving.
LocalBuilder = Callable[[], LocalBackend]


class LocalStart:
    """Starts local serving off the loop once the app starts, holds the backend once built, and closes
    it when the app stops; what the routes ask while it starts (`backend_for`, `wait`, `state`)."""

    def __init__(self, build: LocalBuilder | None, models: Collection[str] | None = None) -> None:
        self._build = build
        # The turns that wait for the start: those for the models it serves (None: every turn).
        self._models = frozenset(models) if models is not None else None
        self.backend: LocalBackend | None = None  # set on the event loop once built
        self.failure: str | None = None
        # Called on the event loop: once the backend serves / once the start has failed.
        self.on_ready: Callable[[], None] | None = None
        self.on_failure: Callable[[], None] | None = None
        self._done = asyncio.Event()
        self._lock = threading.Lock()  # between the build's thread and the loop: who closes what was built
        self._built: LocalBackend | None = None
        self._stopped = False
        self._since = time.monotonic()

    @property
    def state(self) -> str:
        """`starting`, `ready` or `failed`; `ready` at once when there is nothing to start."""
        if self.failure is not None:
            return "failed"
        return "ready" if self._done.is_set() else "starting"

    def begin(self) -> None:
        """On the event loop, as the app starts (before it listens): the build's thread starts."""
        if self._build is None:
            self._done.set()
            return
        loop = asyncio.get_running_loop()
        self._since = time.monotonic()
        threading.Thread(target=self._run, args=(loop,), name="attnstore-local-start", daemon=True).start()

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._build is not None
        try:
            backend = self._build()
        except Exception as exc:
            if self._stopped:  # the app is gone: nothing to tell
                return
            reason = str(exc) or type(exc).__name__
            if not isinstance(exc, ModelLoadError):  # that one is told in one line, not a traceback
                log.exception("local serving failed to start")
            self._to_loop(loop, self._failed, reason)
            return
        with self._lock:
            handed_over = not self._stopped
            if handed_over:
                self._built = backend
        if not handed_over:  # the app stopped meanwhile: nobody else will close it
            backend.close()
            return
        self._to_loop(loop, self._ready)

    @staticmethod
    def _to_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
        # RuntimeError: the loop has closed (the app is gone; its `close` ran first, so the build's
        # thread closed what it built)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)

    def _ready(self) -> None:
        with self._lock:
            self.backend = self._built
        self._done.set()
        if self.backend is not None:
            took_s = time.monotonic() - self._since
            log.info("local serving ready (%.1f s after the server started listening)", took_s)
            if self.on_ready is not None:
                self.on_ready()

    def _failed(self, reason: str) -> None:
        self.failure = reason
        self._done.set()
        log.error("cannot start: %s", reason)
        if self.on_failure is not None:
            self.on_failure()

    async def wait(self) -> None:
        """Until the start has ended, either way."""
        await self._done.wait()

    async def backend_for(self, model: str) -> LocalBackend | None:
        """The backend a turn for `model` is routed with: for a model this start serves, once it has
        started (a 503 with the reason when it could not); for any other, whatever serves now."""
        waits = self._build is not None and (self._models is None or model in self._models)
        if waits and not self._done.is_set():
            await self._done.wait()
        if waits and self.failure is not None:
            raise APIError(503, f"The local model could not start: {self.failure}", code="local_start_failed")
        return self.backend

    async def close(self) -> None:
        """On the event loop, as the app stops: what was built is closed (off the loop); a build still
        running closes its backend itself when it ends."""
        with self._lock:
            self._stopped = True
            backend, self._built, self.backend = self._built, None, None
        if backend is not None:
            await backend.aclose()
            await asyncio.to_thread(backend.close)


# The local backend's start (and, once started, the backend): set when the app is built.
LOCAL_START: web.AppKey[LocalStart] = web.AppKey("local_start", LocalStart)


def local_backend(app: web.Application) -> LocalBackend | None:
    """The backend serving now: None while it starts, or with no local serving (all upstream)."""
    return app[LOCAL_START].backend


def local_engine(app: web.Application) -> Engine | None:
    """The engine local turns run on, or None (not started, no local serving, or a stand-in)."""
    backend = app[LOCAL_START].backend
    return backend.engine if backend is not None else None
