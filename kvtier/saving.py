"""Saving to the persistent tier: the response never waits for the disk. put() reserves a place and
hands the chunk to a bounded pool of save threads, or, with async_save off, writes the batch before
returning. When the disk falls behind and the pool's queue is full, the chunk is not written (it stays
in the memory tiers that hold it, counted in `saves_skipped`): a turn's end, and with it the client's
answer and the step's freed pages, never waits for the disk, and unsaved chunks never pile up in memory. A full disk pauses saving (serving goes on from
memory) and saving tries again after a back-off that doubles from `disk_full_backoff_s` up to 60 s
while the disk stays full.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass

from .chunk import ChunkId, ChunkKV
from .chunk_format import ChunkMeta
from .core import StoreCore
from .index import Entry
from .placement import Placement
from .save_pool import SavePool

log = logging.getLogger(__name__)

# Each further ENOSPC doubles the pause up to this cap.
DISK_FULL_BACKOFF_MAX_S = 60.0
# Skipped saves (a full save queue) are logged at most this often: a slow disk skips many.
SKIP_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class Save:
    """One chunk to write: its entry and the buffer its reservation holds."""

    entry: Entry
    data: ChunkKV


class Saving:
    def __init__(self, core: StoreCore, placement: Placement) -> None:
        self._core = core
        self._placement = placement
        self.pending = 0  # saves reserved and not done yet (under the lock)
        self._paused_until = 0.0  # time.monotonic() before which saving is paused (a full disk)
        self._backoff = 0.0  # the current pause after a full disk; 0 while writes succeed
        self._skip_log_at = 0.0  # time.monotonic() before which a skipped save is not logged again
        config = core.config
        self._pool: SavePool[Save] | None = (
            SavePool(config.save_workers, config.save_queue_chunks, self._write_one)
            if config.async_save
            else None
        )

    @property
    def enabled(self) -> bool:
        """False while saving is paused after a full disk (it retries once the back-off has passed)."""
        return time.monotonic() >= self._paused_until

    def reserve(self, entry: Entry, data: ChunkKV, deletes: list[str]) -> Save | None:
        """With the lock held: reserve the entry's place in the persistent tier, `data` its save in flight."""
        backing = self._core.backing
        if not self.enabled or not self._placement.make_room(backing, entry, deletes):
            return None
        backing.reserve(entry.key, entry.nbytes, data)
        self.pending += 1
        return Save(entry, data)

    def from_host_copies(self, saves: list[Save]) -> list[Save]:
        """With the lock held, once put's copies are queued: a save of a device buffer whose chunk a host
        tier holds now (L0 did not keep it) writes the host copy instead. The device buffer is then not
        held by a save waiting in the queue (device memory no budget counts) and its bytes do not cross
        to the host a second time to be staged."""
        core = self._core
        out: list[Save] = []
        for save in saves:
            key = save.entry.key
            tier = core.memory_tier_of(key)
            host = tier.read(key) if tier is not None else None
            if (
                save.data.buf.is_cuda
                and host is not None
                and not host.buf.is_cuda
                and core.backing.hand_over(key, save.data, host)
            ):
                save = Save(save.entry, host)
            out.append(save)
        return out

    def submit(self, saves: list[Save]) -> None:
        """Without the lock: write reserved chunks (queued; a chunk the full queue cannot take is skipped,
        its reservation undone)."""
        if self._pool is None:
            if saves:
                self._write_batch(saves)
            return
        skipped = [save for save in saves if not self._pool.submit(save)]
        if not skipped:
            return
        with self._core.lock:
            for _ in skipped:
                self._core.counters.save_skipped()
            total = self._core.counters.saves_skipped
        now = time.monotonic()
        if now >= self._skip_log_at:  # one line a minute at most while the disk stays behind
            self._skip_log_at = now + SKIP_LOG_INTERVAL_S
            log.warning(
                "kvtier: the L2 save queue is full (the disk is behind): chunks are kept in memory only "
                "(%d skipped so far)",
                total,
            )
        for save in skipped:
            self._done(save, None)

    def _to_write(self, save: Save) -> tuple[ChunkId, ChunkKV] | None:
        """With the lock held: what to write, or None (saving paused, or the chunk was forgotten)."""
        if (
            save.entry.removed
            or not self.enabled
            or self._core.backing.in_flight(save.entry.key) is not save.data
        ):
            return None
        return save.entry.chunk, save.data

    def _write_one(self, save: Save) -> None:
        """A save worker's job: one chunk."""
        self._write_batch([save])

    def _write_batch(self, saves: list[Save]) -> None:
        """Several chunks in one batch (put() itself when async_save is off): the tier writes every one
        before the first fsync, and fsyncs each folder once."""
        results: list[ChunkMeta | None] = [None] * len(saves)
        try:
            with self._core.lock:
                todo = [(j, item) for j, s in enumerate(saves) if (item := self._to_write(s)) is not None]
            if todo:
                written = self._core.backing.write([item for _, item in todo])
                for (j, _), w in zip(todo, written, strict=True):
                    if isinstance(w, OSError):
                        self._failed(w)
                    else:
                        results[j] = w
        finally:
            for save, meta in zip(saves, results, strict=True):
                self._done(save, meta)

    def _failed(self, e: OSError) -> None:
        with self._core.lock:
            self._core.counters.save_failed()
            if e.errno == errno.ENOSPC:
                if self.enabled:  # the first failure of this pause: one log line, a longer pause
                    first = self._core.config.disk_full_backoff_s
                    self._backoff = min(max(self._backoff * 2, first), DISK_FULL_BACKOFF_MAX_S)
                    self._paused_until = time.monotonic() + self._backoff
                    log.warning(
                        "kvtier: disk full (%s); saving to L2 pauses for %.0f s, serving goes on",
                        e,
                        self._backoff,
                    )
            else:
                log.warning("kvtier: saving a chunk failed: %s", e)

    def _done(self, save: Save, written: ChunkMeta | None) -> None:
        core, entry = self._core, save.entry
        orphan = False
        with core.lock:
            self.pending -= 1
            if entry.removed:  # forgotten or superseded while being written: its file must go
                core.backing.end_save(entry.key, save.data)
                # ... unless a later entry of the same key holds that very file now
                orphan = written is not None and core.backing.read(entry.key) is None
                orphan = orphan and core.backing.in_flight(entry.key) is None
            elif written is not None:
                self._backoff = 0.0  # the disk takes writes again: the next full disk starts at 1 s
                core.backing.finish(entry.key, save.data, written)
                core.counters.saved(entry.nbytes)
            else:
                core.backing.finish(entry.key, save.data, None)
                if not core.usable(entry):
                    core.index.remove(entry.key)
            core.cond.notify_all()
        if orphan:
            core.backing.delete([entry.key])

    def flush(self, timeout: float | None = None) -> None:
        """Wait until no save is pending (or the timeout passes)."""
        with self._core.cond:
            self._core.cond.wait_for(lambda: self.pending == 0, timeout)

    def close(self) -> None:
        self.flush()
        if self._pool is not None:
            self._pool.close()
