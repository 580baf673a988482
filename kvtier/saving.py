"""Saving to L2: the response never waits for the disk. put() reserves an L2 place and hands the chunk
to a bounded pool of save threads (back-pressure when the disk falls behind), or, with async_save off,
writes the batch before returning. A full disk pauses saving (serving goes on from memory) and saving
tries again after a back-off that doubles from 1 s up to 60 s while the disk stays full.
"""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path

from .chunk import ChunkId, ChunkKV
from .chunk_files import chunk_path, write_chunk, write_chunks
from .chunk_format import ChunkMeta
from .index import Entry
from .save_pool import SavePool
from .state import StoreState

log = logging.getLogger(__name__)

# After a full disk, the first retry waits this long; each further ENOSPC doubles it up to the cap.
DISK_FULL_BACKOFF_S = 1.0
DISK_FULL_BACKOFF_MAX_S = 60.0


class Saving:
    def __init__(self, state: StoreState) -> None:
        self._s = state
        self.pending = 0  # saves reserved and not done yet (under the lock)
        self._paused_until = 0.0  # time.monotonic() before which saving is paused (a full disk)
        self._backoff = 0.0  # the current pause after a full disk; 0 while writes succeed
        config = state.config
        self._pool: SavePool[Entry] | None = (
            SavePool(config.save_workers, config.save_queue_chunks, self._write_one)
            if config.async_save
            else None
        )

    @property
    def enabled(self) -> bool:
        """False while saving is paused after a full disk (it retries once the back-off has passed)."""
        return time.monotonic() >= self._paused_until

    def reserve(self, entry: Entry, data: ChunkKV, deletes: list[Path]) -> bool:
        """With the lock held: reserve the entry's L2 place and mark `data` as its save in flight."""
        if not self.enabled or not self._s.placement.reserve_l2(entry, deletes):
            return False
        entry.pending = data
        self.pending += 1
        return True

    def submit(self, entries: list[Entry]) -> None:
        """Without the lock: write reserved entries (blocks while the save queue is full)."""
        if self._pool is not None:
            for entry in entries:
                self._pool.submit(entry)
        elif entries:
            self._write_batch(entries)

    def _to_write(self, entry: Entry) -> tuple[ChunkId, ChunkKV] | None:
        """With the lock held: what to write for an entry, or None (saving stopped, or it was forgotten)."""
        if entry.pending is None or not self.enabled or entry.removed:
            return None
        return entry.chunk, entry.pending

    def _write_one(self, entry: Entry) -> None:
        """A save worker's job: one chunk's L2 file."""
        written: ChunkMeta | None = None
        try:
            with self._s.lock:
                item = self._to_write(entry)
            if item is not None:
                try:
                    s = self._s
                    written = write_chunk(
                        s.root, *item, s.model_fingerprint, s.layout, s.config.drop_page_cache
                    )
                except OSError as e:
                    self._failed(e)
        finally:
            self._done(entry, written)

    def _write_batch(self, entries: list[Entry]) -> None:
        """Several chunks' files in one batch (put() itself when async_save is off): every file is written
        before the first fsync, and each folder is fsynced once."""
        results: list[ChunkMeta | None] = [None] * len(entries)
        try:
            with self._s.lock:
                todo = [(j, item) for j, e in enumerate(entries) if (item := self._to_write(e)) is not None]
            if todo:
                s = self._s
                items = [item for _, item in todo]
                written = write_chunks(s.root, items, s.model_fingerprint, s.layout, s.config.drop_page_cache)
                for (j, _), w in zip(todo, written, strict=True):
                    if isinstance(w, OSError):
                        self._failed(w)
                    else:
                        results[j] = w
        finally:
            for entry, meta in zip(entries, results, strict=True):
                self._done(entry, meta)

    def _failed(self, e: OSError) -> None:
        with self._s.lock:
            self._s.counters.save_errors += 1
            if e.errno == errno.ENOSPC:
                if self.enabled:  # the first failure of this pause: one log line, a longer pause
                    self._backoff = min(max(self._backoff * 2, DISK_FULL_BACKOFF_S), DISK_FULL_BACKOFF_MAX_S)
                    self._paused_until = time.monotonic() + self._backoff
                    log.warning(
                        "kvtier: disk full (%s); saving to L2 pauses for %.0f s, serving goes on",
                        e,
                        self._backoff,
                    )
            else:
                log.warning("kvtier: saving a chunk failed: %s", e)

    def _done(self, entry: Entry, written: ChunkMeta | None) -> None:
        orphan = False
        with self._s.lock:
            entry.pending = None
            self.pending -= 1
            if entry.removed:
                orphan = written is not None  # forgotten or superseded while being written
            elif written is not None:
                self._backoff = 0.0  # the disk takes writes again: the next full disk starts at 1 s
                entry.on_disk, entry.meta = True, written
                self._s.counters.bytes_saved += entry.nbytes
            else:
                self._s.placement.release_l2(entry)
            self._s.cond.notify_all()
        if orphan:
            self._s.unlink([chunk_path(self._s.root, entry.key)])

    def flush(self, timeout: float | None = None) -> None:
        """Wait until no save is pending (or the timeout passes)."""
        with self._s.cond:
            self._s.cond.wait_for(lambda: self.pending == 0, timeout)

    def close(self) -> None:
        self.flush()
        if self._pool is not None:
            self._pool.close()
