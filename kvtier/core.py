"""The store's core: the one owner of what the store's parts share (the lock, the prefix index, the ordered
tiers, the counters, the runner's schedule, the retention table), and the questions about a chunk that
span tiers.

Who writes what: the index writes its entries (index.py), each tier its budget and handles (tier_interface.py),
the counters themselves through their methods (stats.py); the core holds the lock around all of it.
Placement (placement.py) decides moves between tiers; loading, prefetch, saving and adoption call
these objects' methods, never write their fields.

Invariants (under `lock`): every chunk a tier holds has an entry in the index; an entry leaves the
index when no tier (nor a save in flight) holds its bytes; no tier is ever above capacity; entries with
pins > 0 are never evicted. Tensor copies and disk I/O happen with the lock released, so a reader of
stats or a lookup never waits behind a copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

from .chunk import ChunkKV
from .config import StoreConfig, resolve_device
from .index import Entry, PrefixIndex
from .layout import KVLayout
from .load_rates import LoadRates
from .memory_tier import Copy, MemoryTier
from .persistent_tier import PersistentTier
from .retention import Hold, Retention
from .schedule import Schedule
from .stats import Counters
from .tier_interface import TierBackend
from .tier_names import Tier, tier_rank


class StoreCore:
    def __init__(
        self,
        config: StoreConfig,
        layout: KVLayout,
        model_fingerprint: str,
        tiers: Sequence[TierBackend],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: what retention deadlines are measured on (tests pass their own)."""
        self.config = config
        self.layout = layout
        self.model_fingerprint = model_fingerprint
        self.device = resolve_device(config.device)
        self.pin_host = self.device.type == "cuda"  # pinned host buffers only help copies to CUDA
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.index = PrefixIndex()
        self.counters = Counters()
        self.load_rates = LoadRates()  # restore bandwidth per tier, measured (locks itself)
        self.memory, self.backing = _check_tiers(tiers)
        self.tiers: tuple[TierBackend, ...] = (*self.memory, self.backing)
        # The memory tiers a turn's new KV (put) and a load's chunks (promotion) may go to: all of them,
        # fastest first; with the "throughput" hint, all but the fastest (kept for queued jobs).
        self.keep = self.memory if config.placement_hint == "ttft_priority" else self.memory[1:]
        # The runner's queue (schedule.py); None: each tier's own policy order, with pins.
        self.schedule: Schedule | None = None
        # Sessions kept ahead of idle ones until a deadline (retention.py): eviction gives them up last.
        self.retention = Retention(clock)

    # ---- where a chunk is (lock held) ---------------------------------------------------------------

    def memory_tier_of(self, key: str) -> MemoryTier | None:
        """The memory tier holding the chunk's tensors (at most one does)."""
        return next((t for t in self.memory if t.read(key) is not None), None)

    def memory_copy(self, key: str) -> ChunkKV | None:
        """A buffer a load may read the chunk from: a memory tier's, else a save's in flight."""
        tier = self.memory_tier_of(key)
        return tier.read(key) if tier is not None else self.backing.in_flight(key)

    def tier_of(self, entry: Entry) -> Tier:
        """Where a load would read it from (a save in flight counts as the backing tier's write buffer)."""
        tier = self.memory_tier_of(entry.key)
        return tier.name if tier is not None else self.backing.name

    def usable(self, entry: Entry) -> bool:
        """Whether some tier, or a save in flight, holds the chunk's bytes."""
        key = entry.key
        return (
            self.memory_tier_of(key) is not None
            or self.backing.read(key) is not None
            or self.backing.in_flight(key) is not None
        )

    def fits_in_memory(self, nbytes: int) -> bool:
        """Could some memory tier take a chunk of this size at all (were everything else evicted)?"""
        return any(t.capacity >= nbytes for t in self.memory)

    def nbytes(self, n_tokens: int) -> int:
        return n_tokens * self.layout.bytes_per_token

    def set_schedule(self, schedule: Schedule | None) -> None:
        with self.lock:
            self.schedule = schedule

    def retained(self) -> dict[str, Hold]:
        """Retained chunk keys and the hold that keeps each (lock held; cached while nothing changes)."""
        return self.retention.chunks(self.index)

    def retained_in(self, tier: TierBackend) -> dict[str, Hold]:
        """The retained chunks this tier keeps ahead of the others (lock held): the latest deadlines
        first, up to `retention_max_share` of its capacity. A hold past that share is ordered as any
        chunk is, so holds never take a whole tier from the sessions that asked for none."""
        retained = self.retained()
        if not retained:
            return retained
        budget = self.config.retention_max_share * tier.capacity
        kept: dict[str, Hold] = {}
        for key, hold in sorted(
            ((k, h) for k, h in retained.items() if k in tier), key=lambda kh: kh[1].deadline, reverse=True
        ):
            entry = self.index.get(key)
            if entry is None:
                continue
            budget -= entry.nbytes
            if budget < 0:
                break
            kept[key] = hold
        return kept

    # ---- pins ---------------------------------------------------------------------------------------

    def pin(self, entries: Iterable[Entry]) -> list[Entry]:
        with self.lock:
            return self.index.pin(entries)

    def unpin(self, pinned: Sequence[Entry]) -> None:
        with self.lock:
            self.index.unpin(pinned)

    # ---- the lock released --------------------------------------------------------------------------

    def run_copies(self, copies: list[Copy]) -> None:
        """Run placement's copies without the lock (call it without holding it), then swap the results
        in under it."""
        if not copies:
            return
        for c in copies:
            c.run()
        with self.lock:
            for c in copies:
                c.tier.commit(c)

    def quarantine(self, key: str, reason: str) -> None:
        self.backing.quarantine(key, reason)
        with self.lock:
            self.counters.file_quarantined()


def _check_tiers(tiers: Sequence[TierBackend]) -> tuple[tuple[MemoryTier, ...], PersistentTier]:
    """Memory tiers fastest first, then one persistent tier, names distinct and in rank order."""
    *memory, backing = tiers
    if not memory or not all(isinstance(t, MemoryTier) for t in memory):
        raise ValueError("a store needs one or more memory tiers first")
    if not isinstance(backing, PersistentTier):
        raise ValueError("a store's last tier must be a persistent one")
    ranks = [tier_rank(t.name) for t in tiers]
    if ranks != sorted(set(ranks)):
        raise ValueError(f"tiers must be distinct and fastest first, got {[t.name for t in tiers]}")
    return tuple(t for t in memory if isinstance(t, MemoryTier)), backing
