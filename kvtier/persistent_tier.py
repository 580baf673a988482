"""The interface of a tier that keeps chunks across restarts and replicas (L2 files; an object store
would be another implementation). Its handle per chunk is the stored chunk's header (ChunkMeta, with
the layer checksums every read verifies).

A chunk enters in two steps, so the response never waits for the write: the store reserves its place
with the buffer to write (`reserve`: a save in flight, which loads read meanwhile and eviction spares),
a save thread writes it (`write`), and `finish` records the written header or gives the place back.
Bookkeeping methods run under the store lock; the I/O ones (abstract here) without it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from .chunk import ChunkId, ChunkKV
from .chunk_format import ChunkMeta, CorruptChunk
from .eviction import EvictionPolicy
from .tier_interface import TierBackend
from .tier_names import Tier


class LayerReader(Protocol):
    """Reads one stored chunk layer by layer, each layer verified against its checksum."""

    def read_layer_into(self, i: int, k_rows: list[np.ndarray], v_rows: list[np.ndarray]) -> None:
        """Layer i's K and V bytes into the given uint8 arrays (in order), then verified; raises
        CorruptChunk (the destinations then hold unverified bytes)."""
        ...

    def read_chunk_layer(self, i: int, chunk: ChunkKV) -> None:
        """Layer i into a host ChunkKV, verified."""
        ...

    def close(self) -> None: ...


class PersistentTier(TierBackend[ChunkMeta]):
    def __init__(self, name: Tier, capacity_bytes: int, policy: EvictionPolicy) -> None:
        super().__init__(name, capacity_bytes, policy)
        self._in_flight: dict[str, ChunkKV] = {}  # key -> the buffer a save is writing

    # ---- bookkeeping (store lock held) ------------------------------------------------------------

    def reserve(self, key: str, nbytes: int, data: ChunkKV) -> None:
        """Take the chunk's place in the budget; `data` is its save in flight until `finish`."""
        self._charge(key, nbytes)
        self._in_flight[key] = data

    def in_flight(self, key: str) -> ChunkKV | None:
        """The buffer a save of this chunk is writing, if one is."""
        return self._in_flight.get(key)

    def hand_over(self, key: str, data: ChunkKV, copy: ChunkKV) -> bool:
        """The save of `data` writes `copy` (the same bytes) instead; False if `data` is not it."""
        if self._in_flight.get(key) is not data:
            return False
        self._in_flight[key] = copy
        return True

    def finish(self, key: str, data: ChunkKV, written: ChunkMeta | None) -> None:
        """The save of `data` is over: keep the written header, or (None) give the place back."""
        self.end_save(key, data)
        if written is not None:
            self._handles[key] = written
        elif key not in self._handles:
            self._discharge(key)

    def end_save(self, key: str, data: ChunkKV) -> None:
        """Forget the buffer of a save that is over (a later save of the same key keeps its own)."""
        if self._in_flight.get(key) is data:
            del self._in_flight[key]

    def evictable(self, key: str) -> bool:
        return key not in self._in_flight  # a save in flight deletes nothing it has not written

    # ---- I/O (store lock released) ------------------------------------------------------------------

    @abstractmethod
    def write(self, items: Sequence[tuple[ChunkId, ChunkKV]]) -> list[ChunkMeta | OSError]:
        """Store each chunk durably; per chunk, its header or the error that stopped it."""

    @abstractmethod
    def reader(self, key: str, meta: ChunkMeta) -> LayerReader:
        """Open a stored chunk to read it layer by layer; raises CorruptChunk or FileNotFoundError."""

    @abstractmethod
    def read_all(self, key: str, meta: ChunkMeta, *, pin: bool = False) -> ChunkKV:
        """Every layer of a stored chunk, verified, in a new host buffer (page-locked with `pin`: it is
        going to a pinned tier); raises as `reader` does."""

    @abstractmethod
    def find(self, key: str) -> ChunkMeta | CorruptChunk | None:
        """A chunk another writer stored (a replica sharing the tier): its header, or None (none there,
        or another model's), or the CorruptChunk it was quarantined for."""

    @abstractmethod
    def scan(self) -> Iterator[ChunkMeta | CorruptChunk]:
        """Every chunk stored before the store started, oldest first (so eviction order follows age),
        and a CorruptChunk for each one found bad and quarantined."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Delete stored chunks (gone already is fine). Called without the store lock, by whoever evicted
        them (a put among others): it should return in microseconds."""

    def close(self) -> None:
        """The store closes: finish what this tier still does in the background."""

    @abstractmethod
    def quarantine(self, key: str, reason: str) -> None:
        """Move a chunk that failed its checks aside (never served again, kept as evidence)."""
