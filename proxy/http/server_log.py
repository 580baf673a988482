"""Malformed requests (bad request line, headers too long, garbage on the port) cost one WARNING line,
rate-limited, instead of aiohttp's traceback at ERROR for each: a client cannot flood the log."""

from __future__ import annotations

import logging
import threading
import time

from aiohttp.http_exceptions import HttpProcessingError

# At most this many lines per window; the next line says how many were left out.
LINES_PER_WINDOW = 10
WINDOW_S = 60.0


class BadRequestLog(logging.Filter):
    """Installed on the "aiohttp.server" logger: rewrites its per-request parse errors in place."""

    def __init__(self, lines: int = LINES_PER_WINDOW, window_s: float = WINDOW_S) -> None:
        super().__init__()
        self._lines, self._window = lines, window_s
        self._start, self._count, self._skipped = 0.0, 0, 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True  # anything else stays as aiohttp logs it
        with self._lock:
            now = time.monotonic()
            if now - self._start >= self._window:
                self._start, self._count = now, 0
            self._count += 1
            if self._count > self._lines:
                self._skipped += 1
                return False
            skipped, self._skipped = self._skipped, 0
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        reason = (getattr(exc, "message", "") or type(exc).__name__).splitlines()[0][:200]
        record.msg = "bad request from %s: %s %s%s"
        record.args = (remote, exc.code, reason, f" ({skipped} more not logged)" if skipped else "")
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        return True


_installed = BadRequestLog()


def install_bad_request_log() -> None:
    """Idempotent: one filter per process, however many apps are built."""
    logger = logging.getLogger("aiohttp.server")
    if _installed not in logger.filters:
        logger.addFilter(_installed)
