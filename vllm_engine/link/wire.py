"""The store's socket: one small request/reply protocol over a UNIX stream socket, torch-free.

Under vLLM the KV tensors live in the worker process, so the store does too; the scheduler (another
process on vLLM's CPU backend, the same one on a single GPU) and attnstore's proxy reach it here. A
request is one line of JSON `{"op": name, ...arguments}`, its reply one line `{"ok": true, "result": ...}`
or `{"ok": false, "error": message}`; a connection carries any number of them, in order.

`StoreSocketServer` serves a handler table on a thread of its own; `StoreClient` (blocking, for vLLM's
scheduler) and `AsyncStoreClient` (for the proxy's event loop) call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger(__name__)

Handler = Callable[..., Any]
MAX_LINE = 64 << 20  # a request carries a prompt's token ids: 64 MB is far beyond any context


class StoreUnavailable(ConnectionError):
    """The store's socket did not answer (not started yet, or its process is gone)."""


class StoreError(RuntimeError):
    """The store answered with an error (a bad request, or the operation failed there)."""


def encode(message: Any) -> bytes:
    return msgspec.json.encode(message) + b"\n"


def _reply(handlers: dict[str, Handler], line: bytes) -> bytes:
    try:
        request = msgspec.json.decode(line)
        op = request.pop("op")
        result = handlers[op](**request)
    except Exception as exc:  # the caller gets the error; the server goes on
        log.warning("attnstore store socket: %s failed: %s", line[:80], exc)
        return encode({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return encode({"ok": True, "result": result})


class StoreSocketServer:
    """Answers requests on `path` (replacing a stale socket file there) until `close()`."""

    def __init__(self, path: str | os.PathLike[str], handlers: dict[str, Handler]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        table = dict(handlers)

        class Connection(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while line := self.rfile.readline(MAX_LINE):
                    self.wfile.write(_reply(table, line))
                    self.wfile.flush()

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self._server = Server(str(self.path), Connection)
        os.chmod(self.path, 0o600)  # owner only: the store holds conversations
        self._thread = threading.Thread(target=self._server.serve_forever, name="attnstore-store-socket")
        self._thread.daemon = True
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _result(raw: bytes) -> Any:
    if not raw:
        raise StoreUnavailable("the store closed the connection")
    reply = msgspec.json.decode(raw)
    if not reply.get("ok"):
        raise StoreError(reply.get("error", "unknown error"))
    return reply.get("result")


class StoreClient:
    """A blocking client with one connection (reopened once when it breaks); safe from any thread."""

    def __init__(self, path: str | os.PathLike[str], timeout_s: float = 30.0) -> None:
        self.path = str(path)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._file: Any = None

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise StoreUnavailable(f"store socket {self.path}: {exc}") from None
        self._sock, self._file = sock, sock.makefile("rb")

    def _drop(self) -> None:
        if self._sock is not None:
            self._file.close()
            self._sock.close()
        self._sock = self._file = None

    def call(self, op: str, **args: Any) -> Any:
        data = encode({"op": op, **args})
        with self._lock:
            for attempt in (1, 2):
                try:
                    if self._sock is None:
                        self._connect()
                    assert self._sock is not None
                    self._sock.sendall(data)
                    return _result(self._file.readline(MAX_LINE))
                except (OSError, StoreUnavailable) as exc:
                    self._drop()
                    if attempt == 2:
                        raise StoreUnavailable(f"store socket {self.path}: {exc}") from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._drop()


class AsyncStoreClient:
    """The proxy's client: one short connection per call, so calls never wait on each other."""

    def __init__(self, path: str | os.PathLike[str], timeout_s: float = 30.0) -> None:
        self.path = str(path)
        self.timeout_s = timeout_s

    async def call(self, op: str, **args: Any) -> Any:
        try:
            raw = await asyncio.wait_for(self._exchange(encode({"op": op, **args})), self.timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise StoreUnavailable(f"store socket {self.path}: {exc or type(exc).__name__}") from None
        return _result(raw)

    async def _exchange(self, data: bytes) -> bytes:
        reader, writer = await asyncio.open_unix_connection(self.path, limit=MAX_LINE)
        try:
            writer.write(data)
            await writer.drain()
            return await reader.readline()
        finally:
            writer.close()
