"""Wait for a condition by polling it until a deadline (never a bare sleep that hopes it is long enough)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


def wait_until(
    check: Callable[[], object],
    what: str,
    timeout: float = 60.0,
    interval: float = 0.05,
    ignore: tuple[type[BaseException], ...] = (),
) -> None:
    """Return as soon as `check()` is truthy; exceptions in `ignore` count as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except ignore:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout}s")
        time.sleep(interval)


async def async_wait_until(
    check: Callable[[], Awaitable[object]], what: str, timeout: float = 60.0, interval: float = 0.05
) -> None:
    """`wait_until` for a coroutine check, without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout}s")
        await asyncio.sleep(interval)
