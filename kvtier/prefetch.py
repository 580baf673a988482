"""Prefetching: the scheduler's look-ahead brings a queued job's chunks up before the job runs.

Chunks only in the persistent tier are read into host memory, and every chunk of the match goes into
the fastest memory tier with room for it (L0 first), evicting only what the schedule allows (never a
chunk a running or window job needs). It runs on a thread the store owns, never on the runner's thread.
A prefetched chunk counts as used when a job's lookup matches it while it is still in memory, and as
wasted when it leaves memory before that. A chunk whose job left the queue before its turn here (the
client went away, or a hit took its place) is skipped: nothing protects it any more, so bringing it up
would only evict what queued jobs need.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from .chunk_format import CorruptChunk
from .config import PrefixMatch
from .core import StoreCore
from .loading import Loading
from .memory_tier import Copy
from .placement import Placement

log = logging.getLogger(__name__)


class Prefetching:
    def __init__(self, core: StoreCore, placement: Placement, loading: Loading) -> None:
        self._core = core
        self._placement = placement
        self._loading = loading
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-prefetch")
        self._idle = threading.Condition()
        self._queued = 0

    def close(self) -> None:
        """Wait for the prefetch in flight; later ones are skipped."""
        self._pool.shutdown(wait=True)

    def prefetch(self, match: PrefixMatch) -> None:
        """Queue the match's chunks to be brought up. Never raises."""
        if not match.chunks:
            return
        with self._core.lock:
            self._core.counters.prefetch_set_out(len(match.chunks))
        with self._idle:
            self._queued += 1
        try:
            self._pool.submit(self._run, match)
        except RuntimeError:  # closed
            self._done()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued prefetch has run; False if the timeout passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout)

    def _done(self) -> None:
        with self._idle:
            self._queued -= 1
            self._idle.notify_all()

    def _run(self, match: PrefixMatch) -> None:
        try:
            for c in match.chunks:
                try:
                    self._bring_up(c.key)
                except Exception:
                    log.exception("kvtier: prefetch of %s failed", c.key)
        finally:
            self._done()

    def _bring_up(self, key: str) -> None:
        core = self._core
        with core.lock:
            e = core.index.get(key)
            if e is None or e.removed:
                return
            if core.schedule is not None and key not in core.schedule.protected:
                return  # its job is neither running nor in the look-ahead window any more
            tier = core.memory_tier_of(key)
            if tier is core.memory[0]:  # already where a job reads fastest
                core.counters.prefetch_placed()
                core.index.mark_prefetched(e)
                return
            data = tier.read(key) if tier is not None else None
            meta = core.backing.read(key)
            if data is None and meta is None:
                return  # a save in flight holds it: a load reads that buffer anyway
            core.pin([e])
        try:
            if data is None:
                assert meta is not None
                try:
                    data = core.backing.read_all(key, meta, pin=core.pin_host)  # L1 keeps it as read
                except (CorruptChunk, OSError) as err:
                    self._loading.on_bad_chunk(key, err)
                    return
            copies: list[Copy] = []
            with core.lock:
                if not e.removed and self._placement.place(e, data, copies, core.memory):
                    core.counters.prefetch_placed()
                    core.index.mark_prefetched(e)
            core.run_copies(copies)
        finally:
            core.unpin([e])
