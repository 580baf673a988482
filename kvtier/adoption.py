"""Adoption of stored chunks into the index: the start-up scan of the persistent tier (a restart keeps
every conversation) and, later, chunks another replica wrote to the shared tier, found by key. A
corrupt chunk is quarantined (by the tier) and counted, a foreign one (another model or layout) left
alone; neither is ever indexed.
"""

from __future__ import annotations

from .chunk_format import ChunkMeta, CorruptChunk
from .core import StoreCore
from .index import Entry
from .placement import Placement


class Adoption:
    def __init__(self, core: StoreCore, placement: Placement) -> None:
        self._core = core
        self._placement = placement

    def scan(self) -> None:
        """Index every valid chunk the persistent tier holds, oldest first (eviction order follows age)."""
        for found in self._core.backing.scan():
            self._take(found)

    def adopt_key(self, key: str) -> bool:
        """Adopt the stored chunk of `key` if there is one (one stat when there is not); True if the key
        is now usable."""
        found = self._core.backing.find(key)
        if found is None or not self._take(found):
            return False
        core = self._core
        with core.lock:
            entry = core.index.get(key)
            return entry is not None and core.usable(entry)

    def _take(self, found: ChunkMeta | CorruptChunk) -> bool:
        if isinstance(found, CorruptChunk):
            with self._core.lock:
                self._core.counters.file_quarantined()
            return False
        self._core.backing.delete(self._adopt(found))
        return True

    def _adopt(self, meta: ChunkMeta) -> list[str]:
        """Index a valid stored chunk (ours from before a restart, or another replica's). Returns keys to
        delete (victims that made room for it)."""
        core = self._core
        deletes: list[str] = []
        with core.lock:
            entry = core.index.get(meta.key)
            saving = core.backing.in_flight(meta.key) is not None
            if entry is None and saving:
                return deletes  # our own save of a chunk forgotten meanwhile: its file is about to go
            if entry is not None and (saving or core.backing.read(meta.key) is not None):
                return deletes
            if entry is None:
                entry = Entry(meta.chunk, core.nbytes(meta.n_tokens))
            if not self._placement.make_room(core.backing, entry, deletes):
                return deletes
            core.backing.admit(meta.key, entry.nbytes, meta)
            if core.index.get(meta.key) is None:
                core.index.add(entry)
        return deletes
