"""What the KV stores learn from the embedded engine's queue (scheduler-aware tiering, docs/tiering.md):
each store's schedule (the chunks of jobs still restoring or prefilling, and of the look-ahead window, are
protected from eviction; other queued jobs' chunks go from the back of the queue), and a prefetch for
each job of the look-ahead window, once.

Hints only: a failure here is logged and never touches a running job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kvtier import KVStore, PrefixMatch, Schedule

from .job_state import JobState
from .jobs import Job

log = logging.getLogger("attnstore.runner")


class StoreHints:
    """Owned by the engine and used on its worker's thread only (no lock): the queue last told to the
    stores, the waiting jobs already prefetched, and each waiting job's stored prefix, looked up once."""

    def __init__(self, stores: Mapping[str, KVStore], *, lookahead: int, scheduler_aware: bool) -> None:
        self._stores = stores
        self._lookahead = lookahead
        self._scheduler_aware = scheduler_aware
        self._seen: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self._prefetched: set[int] = set()  # id(job) of waiting jobs whose prefetch was issued
        self._matches: dict[int, PrefixMatch] = {}  # id(job) -> its stored prefix, while it waits

    def admitted(self, job: Job) -> None:
        """The job left the queue to run: it is no longer the look-ahead window's."""
        self._prefetched.discard(id(job))

    def update(self, running: list[JobState], waiting: list[Job]) -> None:
        """Once per step, `waiting` in admission order: each store's schedule whenever the queue or the
        prefilling jobs changed, then a prefetch for the look-ahead window's jobs not prefetched yet."""
        prefilling = [s for s in running if s.computing and s.prefilling]
        seen = (tuple(id(j) for j in waiting), tuple(id(s) for s in prefilling))
        if seen != self._seen:
            self._seen = seen
            queued = {id(j) for j in waiting}
            self._prefetched &= queued
            self._matches = {k: m for k, m in self._matches.items() if k in queued}
            _safe(self._publish, prefilling, waiting, what="publishing the queue")
        for job in waiting[: self._lookahead]:
            if id(job) not in self._prefetched:
                self._prefetched.add(id(job))
                _safe(self._prefetch, job, what="prefetch")

    def _publish(self, prefilling: list[JobState], waiting: list[Job]) -> None:
        if not (self._scheduler_aware and self._stores):
            return
        for name, store in self._stores.items():
            running = [
                [c.key for c in s.match.chunks]
                for s in prefilling
                if s.match is not None and s.job.request.model == name
            ]
            queue = []
            for job in waiting:
                match = self._match(job) if job.request.model == name else None
                queue.append([c.key for c in match.chunks] if match is not None else [])
            store.set_schedule(Schedule.from_queue(running, queue, self._lookahead))

    def _prefetch(self, job: Job) -> None:
        match = self._match(job)
        if match is not None and match.tokens:
            self._stores[job.request.model].prefetch(match)

    def _match(self, job: Job) -> PrefixMatch | None:
        """A waiting job's stored prefix, looked up once (not counted: its own lookup, when it runs, is
        the hit or miss)."""
        req = job.request
        store = self._stores.get(req.model)
        if store is None or not req.reuse:
            return None
        match = self._matches.get(id(job))
        if match is None:
            match = store.lookup(req.namespace, req.prompt_ids[:-1], hint_keys=req.hint_keys, count=False)
            self._matches[id(job)] = match
        return match


def _safe(fn: Callable[..., Any], *args: Any, what: str) -> None:
    try:
        fn(*args)
    except Exception:  # a hint only: never let it hurt the running jobs
        log.warning("%s failed", what, exc_info=True)
