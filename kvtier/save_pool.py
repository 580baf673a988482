"""A small pool of save threads behind a bounded queue.

The queue bound keeps unsaved chunks from piling up in memory when the disk falls behind; `submit`
never blocks (its caller ends a turn: the turn must not wait for the disk) and says whether the job was
taken. What a save does, and what a refused one means, is the store's business (a callback).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()


class SavePool(Generic[T]):
    def __init__(self, workers: int, queue_size: int, save: Callable[[T], None]) -> None:
        self._save = save
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._threads = [
            threading.Thread(target=self._run, name=f"kvtier-save-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: T) -> bool:
        """Enqueue a job; False (and nothing queued) when the queue is full."""
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            try:
                self._save(job)
            except Exception:  # the callback handles expected errors; never let a worker die
                log.exception("kvtier: save job failed")

    def close(self, timeout: float | None = None) -> None:
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            t.join(timeout)
