"""Loading: restoring a match's chunks on threads the store owns (closed with it).

A load pins its chunks, fills a RestoredKV layer by layer (restore.py), then promotes what it read into
the fastest memory tier that takes it (see StoreState.keep_tiers) and unpins. A chunk that fails to read is quarantined (if its file is bad) and forgotten: a miss,
never a wrong answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from .chunk import ChunkKV
from .chunk_files import chunk_path
from .chunk_format import CorruptChunk
from .config import ChunkRef, PrefixMatch
from .index import Entry
from .placement import Copy
from .restore import KVLoadError, LoadFailure, PlanItem, RestoredKV, other_bad_chunks, run_load
from .state import StoreState

log = logging.getLogger(__name__)


class Loading:
    def __init__(self, state: StoreState) -> None:
        self._s = state
        self._loaders = ThreadPoolExecutor(state.config.load_workers, thread_name_prefix="kvtier-load")

    def close(self) -> None:
        """Wait for loads in flight; later ones fail."""
        self._loaders.shutdown(wait=True)

    # ---- load ----------------------------------------------------------------------------------------

    def load(
        self,
        match: PrefixMatch,
        capacity: int | None,
        out: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> RestoredKV:
        restored = RestoredKV(match.tokens, self._s.layout, self._s.device, capacity, out)
        if match.tokens == 0:
            return restored
        s = self._s
        with s.lock:
            entries = [s.index.get(c.key) for c in match.chunks]
            gone = next(
                (c for c, e in zip(match.chunks, entries, strict=True) if e is None or not e.usable), None
            )
            if gone is not None:
                s.counters.misses += 1
                s.counters.load_errors += 1
                restored.fail(KVLoadError(f"chunk {gone.key} is no longer stored"))
                restored.settle()
                return restored
            pinned = s.pin(e for e in entries if e is not None)
            plan = [self._plan_item(e, c) for e, c in zip(pinned, match.chunks, strict=True)]
        try:
            self._loaders.submit(self._run, plan, restored, pinned)
        except RuntimeError:  # closed
            s.unpin(pinned)
            restored.fail(KVLoadError("the store is closed"))
            restored.settle()
        return restored

    def _plan_item(self, e: Entry, c: ChunkRef) -> PlanItem:
        """With the lock held: read the chunk from memory if a tier (or a save in flight) holds it, else
        from its file."""
        mem = e.data if e.data is not None else e.pending
        if mem is not None:
            return PlanItem(c.key, c.n_tokens, mem=mem)
        path = chunk_path(self._s.root, c.key)
        return PlanItem(c.key, c.n_tokens, path=path, meta=e.meta, buf=self._disk_buffer(e, c))

    def _disk_buffer(self, e: Entry, c: ChunkRef) -> ChunkKV | None:
        """A host buffer to read an L2 chunk into, allocated here in the caller's thread (see RestoredKV),
        or None when the loader can read it straight into the output: host output, whole chunk used,
        and no memory tier that could take the chunk afterwards (promotion needs a copy of its own)."""
        s = self._s
        if s.device.type == "cpu" and c.n_tokens == e.n_tokens and not s.placement.fits_in_memory(e.nbytes):
            return None
        return ChunkKV.empty(s.layout, e.n_tokens, torch.device("cpu"), pin=s.pin_host)

    def _run(self, plan: list[PlanItem], restored: RestoredKV, pinned: list[Entry]) -> None:
        """A load thread: fill the output, then promote; the RestoredKV settles whatever happens."""
        try:
            from_disk = run_load(plan, restored, self._s.layout)
        except LoadFailure as f:
            self._s.unpin(pinned)
            self.on_bad_chunk(f.item.key, f.cause)
            for key, cause in other_bad_chunks(plan, f.item.key, self._s.layout):
                self.on_bad_chunk(key, cause)  # every bad chunk of the match at once
            restored.fail(KVLoadError(str(f)))
        except Exception as e:  # never leave the runner waiting forever
            self._s.unpin(pinned)
            log.exception("kvtier: load failed")
            restored.fail(KVLoadError(f"load failed: {e}"))
        else:
            self._promote(pinned, from_disk, restored.num_tokens)
        finally:
            restored.settle()

    def _promote(self, pinned: list[Entry], from_disk: dict[str, ChunkKV], n_tokens: int) -> None:
        """Put what was read into the fastest memory tier that takes it, then unpin."""
        s = self._s
        copies: list[Copy] = []
        try:
            with s.lock:
                s.counters.bytes_loaded += s.nbytes(n_tokens)
                for e in pinned:
                    if e.removed:
                        continue
                    data = e.data if e.data is not None else from_disk.get(e.key)
                    if data is not None and e.mem_tier != "l0":
                        s.placement.place(e, data, copies, s.keep_tiers)
                    s.placement.touch(e)
            s.move(copies)
        except Exception:
            log.exception("kvtier: promotion after a load failed")
        finally:
            s.unpin(pinned)

    def on_bad_chunk(self, key: str, cause: BaseException) -> None:
        """A chunk failed to load: quarantine a bad file, forget the entry, count a miss."""
        s = self._s
        path = chunk_path(s.root, key)
        if isinstance(cause, CorruptChunk):
            s.quarantine(path, str(cause))
        else:
            log.warning("kvtier: chunk %s could not be read: %s", key, cause)
        with s.lock:
            s.counters.misses += 1
            s.counters.load_errors += 1
            entry = s.index.get(key)
            if entry is not None and entry.data is None and entry.pending is None:
                s.placement.remove(entry)  # its file is gone or quarantined already
