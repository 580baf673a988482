"""Prefetching: the scheduler's look-ahead brings a queued job's chunks up before the job runs.

Chunks only on disk are read into host memory, and every chunk of the match goes into the fastest
memory tier with room for it (L0 first), evicting only what the schedule allows (never a chunk a
running or window job needs). It runs on a thread the store owns, never on the runner's thread.
A prefetched chunk counts as used when a job's lookup matches it while it is still in memory, and as
wasted when it leaves memory before that.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from .chunk_files import chunk_path, read_chunk
from .chunk_format import CorruptChunk
from .config import PrefixMatch
from .loading import Loading
from .placement import Copy
from .state import StoreState
from .tiers import MEMORY_TIERS

log = logging.getLogger(__name__)


class Prefetching:
    def __init__(self, state: StoreState, loading: Loading) -> None:
        self._s = state
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
        with self._s.lock:
            self._s.counters.prefetch_issued += len(match.chunks)
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
        s = self._s
        with s.lock:
            e = s.index.get(key)
            if e is None or e.removed:
                return
            if e.mem_tier == "l0":  # already where a job reads fastest
                s.counters.prefetch_completed += 1
                e.prefetched = True
                return
            data = e.data
            if data is None and (not e.on_disk or e.meta is None):
                return  # a save in flight holds it: a load reads that buffer anyway
            meta = e.meta
            s.pin([e])
        try:
            if data is None:
                assert meta is not None
                try:
                    data = read_chunk(chunk_path(s.root, key), meta, s.layout)
                except (CorruptChunk, OSError) as err:
                    self._loading.on_bad_chunk(key, err)
                    return
            copies: list[Copy] = []
            with s.lock:
                if not e.removed and s.placement.place(e, data, copies, MEMORY_TIERS):
                    s.counters.prefetch_completed += 1
                    e.prefetched = True
            s.move(copies)
        finally:
            s.unpin([e])
