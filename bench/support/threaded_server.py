"""Run any aiohttp application on 127.0.0.1:<free port> in a background thread with its own event loop.

    from bench.support.threaded_server import AppServer, serve_in_thread

    with serve_in_thread(build_app(settings)) as server:     # or: server = AppServer(app).start() ... .stop()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k")
        ...

`app` may be a `web.Application` or a callable returning one (sync or async; called on the server's loop,
handy when building the app must happen inside a running loop). Because the server has its own loop and
thread, synchronous clients (the official `openai` client, `urllib`) and aiohttp clients running on the
test's loop both work. `stop()` runs the app's cleanup (cleanup_ctx, on_cleanup) and joins the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web


def free_port() -> int:
    """A loopback port free right now (for servers started as separate processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


AppSource = web.Application | Callable[[], web.Application | Awaitable[web.Application]]


class AppServer:
    def __init__(
        self,
        app: AppSource,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        handler_cancellation: bool = True,
        shutdown_timeout_s: float = 2.0,
        start_timeout_s: float = 60.0,
    ) -> None:
        self._source = app
        self.host, self.port = host, port
        # True like `attnstore serve`: a client that disconnects cancels its handler.
        self._handler_cancellation = handler_cancellation
        # How long start() waits for the server, and how long stop() lets in-flight requests finish
        # before they are cancelled.
        self._start_timeout_s, self._shutdown_timeout_s = start_timeout_s, shutdown_timeout_s
        self.app: web.Application | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """Base URL without a trailing slash, e.g. http://127.0.0.1:40123."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> AppServer:
        self._thread = threading.Thread(target=self._run, name=f"AppServer-{id(self):x}", daemon=True)
        self._thread.start()
        if not self._ready.wait(self._start_timeout_s):
            raise TimeoutError(f"app server did not start within {self._start_timeout_s}s")
        if self._error is not None:
            self._thread.join(5)
            raise RuntimeError("app server failed to start") from self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._setup())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._runner.cleanup())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _setup(self) -> None:
        app: Any = self._source
        if not isinstance(app, web.Application):
            app = app()
            if inspect.isawaitable(app):
                app = await app
        self.app = app
        self._runner = web.AppRunner(
            app,
            handler_cancellation=self._handler_cancellation,
            access_log=None,
            shutdown_timeout=self._shutdown_timeout_s,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def call(self, coro: Awaitable[Any], timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop from another thread and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None or self.loop is None or not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("app server thread did not stop")

    def __enter__(self) -> AppServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serve_in_thread(app: AppSource, **kwargs: Any) -> Iterator[AppServer]:
    """Context manager form of `AppServer(app, **kwargs).start()` / `.stop()`."""
    server = AppServer(app, **kwargs).start()
    try:
        yield server
    finally:
        server.stop()
