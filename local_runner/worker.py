"""The one thread that owns the model: admits jobs from a bounded queue and interleaves them step by step.

Compute never runs on the event loop. Each round gives every running job one step (a prefill chunk or
one decoded token), so a long answer or a long prompt does not hold a short one back. Jobs waiting in
the queue are the scheduler's hint: their stored KV is fetched towards the fast tiers before they run.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from .engine import JobState
from .jobs import Failed, Finished, Job

log = logging.getLogger("attnstore.runner")


class QueueFull(RuntimeError):
    """The local queue is at `max_queue`: the caller answers 503 or sends the request upstream."""


class Worker:
    def __init__(
        self,
        start_job: Callable[[Job], JobState],
        prefetch: Callable[[Job], None],
        *,
        max_queue: int,
        max_running: int,
        lookahead: int,
        warmup: Callable[[], None] | None = None,
    ):
        self._warmup = warmup
        self._start_job = start_job
        self._prefetch = prefetch
        self._max_queue = max_queue
        self._max_running = max_running
        self._lookahead = lookahead
        self._pending: deque[Job] = deque()
        self._running: list[JobState] = []
        self._prefetched: set[int] = set()
        self._cond = threading.Condition()
        self._stopping = False
        self.cancelled = 0  # jobs stopped because their client went away
        self._thread = threading.Thread(target=self._run, name="attnstore-runner", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise QueueFull("the local runner is shutting down")
            if len(self._running) >= self._max_running and len(self._pending) >= self._max_queue:
                raise QueueFull(f"the local queue is full ({self._max_queue} waiting)")
            self._pending.append(job)
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        if self._warmup is not None:
            try:
                self._warmup()
            except Exception:  # a slower first request is all a failed warm-up costs
                log.warning("warm-up failed", exc_info=True)
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self._running:
                    self._cond.wait()
                if self._stopping:
                    break
                admitted = []
                while self._pending and len(self._running) + len(admitted) < self._max_running:
                    admitted.append(self._pending.popleft())
                upcoming = [
                    j for j in list(self._pending)[: self._lookahead] if id(j) not in self._prefetched
                ]
            for job in admitted:
                self._prefetched.discard(id(job))
                self._admit(job)
            for job in upcoming:
                self._prefetched.add(id(job))
                self._safe_prefetch(job)
            for state in list(self._running):
                state.step()
                if state.finished:
                    self._running.remove(state)
                    self.cancelled += state.finish_reason == "cancelled"
        self._fail_all("the local runner stopped")

    def _admit(self, job: Job) -> None:
        if job.cancelled:  # its client left while it waited: end it like a cancelled running job
            job.emit(Finished("cancelled", len(job.request.prompt_ids), 0, 0))
            self.cancelled += 1
            return
        try:
            self._running.append(self._start_job(job))
        except Exception as exc:
            log.exception("could not start a job")
            job.emit(Failed(f"could not start: {exc}"))

    def _safe_prefetch(self, job: Job) -> None:
        try:
            self._prefetch(job)
        except Exception:  # a hint only: never let it hurt the jobs that are running
            log.warning("prefetch failed", exc_info=True)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            jobs = [s.job for s in self._running] + list(self._pending)
            self._running.clear()
            self._pending.clear()
        for job in jobs:
            job.emit(Failed(message))
