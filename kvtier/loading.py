"""Loading: restoring a match's chunks on threads the store owns (closed with it).

A load pins its chunks, fills a RestoredKV layer by layer (restore.py), then promotes what it read into
the fastest memory tier that takes it (StoreCore.keep) and unpins. A chunk that fails to read is
quarantined (if its stored copy is bad) and forgotten: a miss, never a wrong answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from .chunk import ChunkKV
from .chunk_format import CorruptChunk
from .config import ChunkRef, PrefixMatch
from .core import StoreCore
from .index import Entry
from .memory_tier import Copy
from .placement import Placement
from .restore import LoadFailure, PlanItem, other_bad_chunks, run_load
from .restored_kv import KVLoadError, RestoredKV

log = logging.getLogger(__name__)


class Loading:
    def __init__(self, core: StoreCore, placement: Placement) -> None:
        self._core = core
        self._placement = placement
        self._loaders = ThreadPoolExecutor(core.config.load_workers, thread_name_prefix="kvtier-load")

    def close(self) -> None:
        """Wait for loads in flight; later ones fail."""
        self._loaders.shutdown(wait=True)

    def load(
        self,
        match: PrefixMatch,
        capacity: int | None,
        out: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> RestoredKV:
        core = self._core
        restored = RestoredKV(match.tokens, core.layout, core.device, capacity, out)
        if match.tokens == 0:
            return restored
        with core.lock:
            entries = [core.index.get(c.key) for c in match.chunks]
            gone = next(
                (c for c, e in zip(match.chunks, entries, strict=True) if e is None or not core.usable(e)),
                None,
            )
            if gone is not None:
                core.counters.load_failed()
                restored.fail(KVLoadError(f"chunk {gone.key} is no longer stored"))
                restored.settle()
                return restored
            pinned = core.pin(e for e in entries if e is not None)
            plan = [self._plan_item(e, c) for e, c in zip(pinned, match.chunks, strict=True)]
        try:
            self._loaders.submit(self._run, plan, restored, pinned)
        except RuntimeError:  # closed
            core.unpin(pinned)
            restored.fail(KVLoadError("the store is closed"))
            restored.settle()
        return restored

    def _plan_item(self, e: Entry, c: ChunkRef) -> PlanItem:
        """With the lock held: read the chunk from memory if a tier (or a save in flight) holds it, else
        from the persistent tier."""
        mem = self._core.memory_copy(e.key)
        if mem is not None:
            return PlanItem(c.key, c.n_tokens, mem=mem)
        meta = self._core.backing.read(e.key)
        return PlanItem(c.key, c.n_tokens, meta=meta, buf=self._disk_buffer(e, c))

    def _disk_buffer(self, e: Entry, c: ChunkRef) -> ChunkKV | None:
        """A host buffer to read a stored chunk into, allocated here in the caller's thread (see
        RestoredKV), or None when the loader can read it straight into the output: host output, whole
        chunk used, and no memory tier that could take the chunk afterwards (promotion needs a copy)."""
        core = self._core
        if core.device.type == "cpu" and c.n_tokens == e.n_tokens and not core.fits_in_memory(e.nbytes):
            return None
        return ChunkKV.empty(core.layout, e.n_tokens, torch.device("cpu"), pin=core.pin_host)

    def _run(self, plan: list[PlanItem], restored: RestoredKV, pinned: list[Entry]) -> None:
        """A load thread: fill the output, then promote; the RestoredKV settles whatever happens."""
        core = self._core
        try:
            from_disk = run_load(plan, restored, core.layout, core.backing.reader)
        except LoadFailure as f:
            core.unpin(pinned)
            self.on_bad_chunk(f.item.key, f.cause)
            for key, cause in other_bad_chunks(plan, f.item.key, core.backing.read_all):
                self.on_bad_chunk(key, cause)  # every bad chunk of the match at once
            restored.fail(KVLoadError(str(f)))
        except Exception as e:  # never leave the runner waiting forever
            core.unpin(pinned)
            log.exception("kvtier: load failed")
            restored.fail(KVLoadError(f"load failed: {e}"))
        else:
            self._promote(pinned, from_disk, restored.num_tokens)
        finally:
            restored.settle()

    def _promote(self, pinned: list[Entry], from_disk: dict[str, ChunkKV], n_tokens: int) -> None:
        """Put what was read into the fastest memory tier that takes it, then unpin."""
        core = self._core
        copies: list[Copy] = []
        try:
            with core.lock:
                core.counters.loaded(core.nbytes(n_tokens))
                for e in pinned:
                    if e.removed:
                        continue
                    tier = core.memory_tier_of(e.key)
                    data = tier.read(e.key) if tier is not None else from_disk.get(e.key)
                    if data is not None and tier is not core.memory[0]:
                        self._placement.place(e, data, copies, core.keep)
                    self._placement.touch(e)
            core.run_copies(copies)
        except Exception:
            log.exception("kvtier: promotion after a load failed")
        finally:
            core.unpin(pinned)

    def on_bad_chunk(self, key: str, cause: BaseException) -> None:
        """A chunk failed to load: quarantine a bad stored copy, forget the entry, count a miss."""
        core = self._core
        if isinstance(cause, CorruptChunk):
            core.quarantine(key, str(cause))
        else:
            log.warning("kvtier: chunk %s could not be read: %s", key, cause)
        with core.lock:
            core.counters.load_failed()
            entry = core.index.get(key)
            if entry is not None and core.memory_copy(key) is None:
                self._placement.remove(entry)  # its stored copy is gone or quarantined already
