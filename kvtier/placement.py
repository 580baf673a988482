"""Placement and eviction: which tier holds which chunk, always within budget.

Eviction demotes (L0 -> L1) before it drops, L2 drops its least recently used file, and a pinned chunk
(or, in L2, one whose save is in flight) is never a victim. Every method here runs with the store lock
held, so none of them copies tensors: a move to another device is split in two. `place` decides, does
the accounting and points the entry at a buffer it already has (the bytes are valid, perhaps on the old
device: ChunkKV is never mutated), and hands back a Copy; the caller runs the copies with the lock
released, then `commit` swaps each result in if the entry is still where it was placed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .chunk import ChunkKV
from .chunk_files import chunk_path
from .index import Entry, PrefixIndex
from .schedule import Schedule, eviction_order
from .tiers import MEMORY_TIERS, TIERS, Tier, TierBudget

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Copy:
    """A chunk buffer to bring onto its tier's device once the store lock is released."""

    entry: Entry
    tier: Tier
    source: ChunkKV
    device: torch.device
    pin: bool
    result: ChunkKV | None = None

    def run(self) -> None:
        """Without the lock: the copy itself (no copy when the buffer is on that device already)."""
        try:
            self.result = self.source.to(self.device, pin=self.pin)
        except Exception:  # the entry keeps its valid source buffer; only the device is off
            log.exception("kvtier: moving chunk %s to %s failed", self.entry.key, self.tier)


class Placement:
    """The tier budgets and what placing, demoting and evicting an index entry means."""

    def __init__(
        self,
        index: PrefixIndex,
        root: Path,
        capacities: dict[Tier, int],
        device: torch.device,
        pin_host: bool,
    ) -> None:
        self._index = index
        self._root = root
        self._device = device
        self._pin_host = pin_host
        self.budgets = {t: TierBudget(t, capacities[t]) for t in TIERS}
        # The runner's queue (see schedule.py); None: plain LRU with pins (scheduler_aware off).
        self.schedule: Schedule | None = None
        self.on_evict: Callable[[Entry], None] = lambda entry: None  # an entry left the memory tiers

    def _evictable(self, tier: Tier) -> Callable[[str], bool]:
        protected = self.schedule.protected if self.schedule is not None else frozenset()

        def ok(key: str) -> bool:
            e = self._index.get(key)
            return (
                e is not None and e.pins == 0 and key not in protected and (tier != "l2" or e.pending is None)
            )

        return ok

    def _victims(self, tier: Tier, nbytes: int) -> list[str] | None:
        schedule = self.schedule
        order = None if schedule is None else (lambda keys: eviction_order(keys, schedule))
        return self.budgets[tier].victims(nbytes, self._evictable(tier), order)

    def fits_in_memory(self, nbytes: int) -> bool:
        """Could some memory tier take a chunk of this size at all (were everything else evicted)?"""
        return any(self.budgets[t].capacity >= nbytes for t in MEMORY_TIERS)

    def place(
        self, entry: Entry, data: ChunkKV, copies: list[Copy], tiers: Sequence[Tier] = MEMORY_TIERS
    ) -> bool:
        """Put `data` in the first of `tiers` where it fits (demoting LRU victims); False if none.
        Appends to `copies` what must move between devices (victims included)."""
        for name in tiers:
            budget = self.budgets[name]
            if entry.mem_tier == name:
                budget.touch(entry.key)
                return True
            victims = self._victims(name, entry.nbytes)
            if victims is None:
                continue
            for key in victims:
                self._evict_mem(name, key, copies)
            if entry.mem_tier is not None:
                self.budgets[entry.mem_tier].remove(entry.key)
            budget.add(entry.key, entry.nbytes)
            entry.data, entry.mem_tier = data, name
            target = self._device if name == "l0" else torch.device("cpu")
            copies.append(Copy(entry, name, data, target, self._pin_host and name == "l1"))
            return True
        return False

    def _evict_mem(self, tier: Tier, key: str, copies: list[Copy]) -> None:
        entry = self._index.get(key)
        assert entry is not None
        budget = self.budgets[tier]
        budget.remove(key)
        budget.evictions += 1
        data, entry.data, entry.mem_tier = entry.data, None, None
        if tier == "l0" and data is not None and self.place(entry, data, copies, ("l1",)):
            return
        self.on_evict(entry)  # it leaves memory
        if not entry.usable:
            self._index.remove(key)

    def demote_all(self, tier: Tier, copies: list[Copy]) -> int:
        """Evict every evictable chunk of a memory tier (L0 demotes to L1 where it fits). Bytes freed."""
        evictable = self._evictable(tier)
        freed = 0
        for key in self.budgets[tier].lru_keys():
            e = self._index.get(key)
            if e is not None and evictable(key):
                freed += e.nbytes
                self._evict_mem(tier, key, copies)
        return freed

    def shed(self, nbytes: int, tiers: Sequence[Tier] = ("l1", "l0")) -> int:
        """Memory pressure: drop the memory copies of chunks that are safe on disk (never pinned or
        protected ones), in eviction order, until `nbytes` are freed. Returns the bytes freed."""
        freed = 0
        for tier in tiers:
            budget = self.budgets[tier]
            evictable = self._evictable(tier)
            for key in eviction_order(budget.lru_keys(), self.schedule):
                if freed >= nbytes:
                    return freed
                e = self._index.get(key)
                if e is None or not e.on_disk or not evictable(key):
                    continue
                budget.remove(key)
                budget.evictions += 1
                e.data, e.mem_tier = None, None
                self.on_evict(e)
                freed += e.nbytes
        return freed

    def commit(self, copies: list[Copy]) -> None:
        """Swap in the finished copies of entries still placed where the copy was meant for."""
        for c in copies:
            e = c.entry
            if c.result is not None and not e.removed and e.data is c.source and e.mem_tier == c.tier:
                e.data = c.result

    def reserve_l2(self, entry: Entry, deletes: list[Path]) -> bool:
        """Make room for the entry's file in L2 (LRU files go: their paths are added to `deletes`)."""
        budget = self.budgets["l2"]
        victims = self._victims("l2", entry.nbytes)
        if victims is None:
            return False
        for key in victims:
            victim = self._index.get(key)
            assert victim is not None
            budget.remove(key)
            budget.evictions += 1
            victim.on_disk, victim.meta = False, None
            deletes.append(chunk_path(self._root, key))
            if not victim.usable:
                self._index.remove(key)
        budget.add(entry.key, entry.nbytes)
        return True

    def release_l2(self, entry: Entry) -> None:
        """A reserved L2 place whose save failed: give it back, and forget the entry if nothing holds it."""
        self.budgets["l2"].remove(entry.key)
        if not entry.usable:
            self._index.remove(entry.key)

    def remove(self, entry: Entry) -> list[Path]:
        """Drop an entry from every tier; returns its file to delete (a save in flight deletes its own)."""
        for budget in self.budgets.values():
            budget.remove(entry.key)
        self._index.remove(entry.key)
        entry.data, entry.mem_tier = None, None
        paths = [chunk_path(self._root, entry.key)] if entry.on_disk else []
        entry.on_disk = False
        return paths

    def touch(self, entry: Entry) -> None:
        for budget in self.budgets.values():
            budget.touch(entry.key)
