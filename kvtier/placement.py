"""Placement: which tier holds which chunk, always within budget. Moves between tiers are decided here and
carried out by the tiers' own methods (admit, drop) and the index's (remove).

Eviction demotes (a memory tier's victim goes to the slower memory tiers) before it drops, the persistent
tier drops in its policy's order, and a pinned or schedule-protected chunk (or, on disk, one whose save
is in flight) is never a victim. Retained chunks (retention.py) are victims only after every other chunk,
and a chunk no hold keeps goes to a slower tier rather than push a held one out; when one goes all the
same (memory ran out), its hold is broken: counted once per hold, and logged. Every method runs with the
store lock held and copies nothing: a move to another device comes back as a Copy, which the caller runs
once it has released the lock (StoreCore.run_copies).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from .chunk import ChunkKV
from .core import StoreCore
from .index import Entry
from .memory_tier import Copy, MemoryTier
from .tier_interface import TierBackend

log = logging.getLogger(__name__)


class Placement:
    def __init__(self, core: StoreCore) -> None:
        self._core = core
        self._index = core.index

    def _evictable(self) -> Callable[[str], bool]:
        """The store's own rule: a pinned chunk stays. (What the schedule protects never reaches it:
        the tier's eviction order leaves it out, see TierBackend.ordered.)"""

        def ok(key: str) -> bool:
            e = self._index.get(key)
            return e is not None and e.pins == 0

        return ok

    def place(self, entry: Entry, data: ChunkKV, copies: list[Copy], tiers: Sequence[MemoryTier]) -> bool:
        """Put `data` in the first of `tiers` where it fits (demoting victims); False if none. Appends to
        `copies` what must move between devices (victims included).

        A chunk no retention hold keeps goes to a slower tier rather than push a held session out of a
        faster one: a hold gives way only where memory would otherwise run out (no tier could take the
        chunk without it), and then the earliest deadline first (the eviction order)."""
        core = self._core
        retained = core.retained()
        spare_holds = bool(retained) and entry.key not in retained
        for may_break_holds in (False, True) if spare_holds else (True,):
            for tier in tiers:
                if core.memory_tier_of(entry.key) is tier:  # already here: nothing faster took it
                    tier.touch(entry.key, counted=False)
                    return True
                kept = core.retained_in(tier)
                victims = tier.victims(entry.nbytes, self._evictable(), core.schedule, kept)
                if victims is None or (not may_break_holds and any(k in kept for k in victims)):
                    continue
                for key in victims:
                    self._evict_memory(tier, key, copies)
                current = core.memory_tier_of(entry.key)  # after the victims: a demotion may have moved it
                if current is not None:
                    current.drop(entry.key)
                copies.append(tier.place(entry.key, entry.nbytes, data))
                return True
        return False

    def _evict_memory(self, tier: MemoryTier, key: str, copies: list[Copy]) -> None:
        """A memory tier's victim goes to the slower memory tiers where it fits, else leaves memory."""
        entry = self._index.get(key)
        assert entry is not None
        self._leaving(key, tier.name)
        data = tier.drop(key, evicted=True)
        slower = self._core.memory[self._core.memory.index(tier) + 1 :]
        if data is not None and slower and self.place(entry, data, copies, slower):
            return
        self._left_memory(entry)

    def _leaving(self, key: str, tier: str) -> None:
        """A chunk is evicted from `tier`: if a retention hold keeps it, pressure broke that hold (the
        eviction order gave up every unretained chunk first)."""
        core = self._core
        hold = core.retained().get(key)
        if hold is None or not core.retention.broke(hold):
            return
        core.counters.retention_broken()
        log.warning(
            "kvtier: memory pressure broke the retention of session %s (%.0f s before its deadline): "
            "its KV leaves %s (%d holds broken so far)",
            hold.session,
            hold.deadline - core.retention.now(),
            tier,
            core.counters.retention_evictions,
        )

    def _left_memory(self, entry: Entry) -> None:
        if self._index.take_prefetched(entry):
            self._core.counters.prefetch_was_wasted()  # a prefetch brought it up in vain
        if not self._core.usable(entry):
            self._index.remove(entry.key)

    def demote_all(self, tier: MemoryTier, copies: list[Copy]) -> int:
        """Evict every evictable chunk of a memory tier (demoted where the slower tiers have room), in
        eviction order: what the schedule needs soonest is demoted last. Returns the bytes that left it."""
        evictable = self._evictable()
        freed = 0
        for key in tier.ordered(self._core.schedule, self._core.retained_in(tier)):
            e = self._index.get(key)
            if e is not None and key in tier and evictable(key):
                freed += e.nbytes
                self._evict_memory(tier, key, copies)
        return freed

    def shed(self, nbytes: int) -> int:
        """Memory pressure: drop the memory copies of chunks that are safe in the persistent tier (never
        pinned or protected ones), slowest memory tier first, in eviction order, until `nbytes` are
        freed. Returns the bytes freed."""
        core = self._core
        evictable = self._evictable()
        freed = 0
        for tier in reversed(core.memory):
            for key in tier.ordered(core.schedule, core.retained_in(tier)):
                if freed >= nbytes:
                    return freed
                e = self._index.get(key)
                if e is None or core.backing.read(key) is None or not evictable(key):
                    continue
                self._leaving(key, tier.name)
                tier.drop(key, evicted=True)
                self._left_memory(e)
                freed += e.nbytes
        return freed

    def make_room(self, tier: TierBackend, entry: Entry, deletes: list[str]) -> bool:
        """Evict from a persistent tier until the entry fits (the victims' keys are added to `deletes`,
        for the caller to delete once the lock is released); False if it cannot fit."""
        victims = tier.victims(
            entry.nbytes, self._evictable(), self._core.schedule, self._core.retained_in(tier)
        )
        if victims is None:
            return False
        for key in victims:
            victim = self._index.get(key)
            assert victim is not None
            if self._core.memory_tier_of(key) is None:  # its last copy goes (a memory copy keeps it)
                self._leaving(key, tier.name)
            if tier.drop(key, evicted=True) is not None:
                deletes.append(key)
            if not self._core.usable(victim):
                self._index.remove(key)
        return True

    def remove(self, entry: Entry) -> list[str]:
        """Drop an entry from every tier and the index; returns its key when its stored copy must be
        deleted (a save in flight deletes its own file once written)."""
        for tier in self._core.memory:
            tier.drop(entry.key)
        stored = self._core.backing.drop(entry.key)
        self._index.remove(entry.key)
        return [entry.key] if stored is not None else []

    def touch_chain(self, entries: Sequence[Entry], *, counted: bool = True) -> None:
        """Touch a chain's chunks (root first as given) in every tier, the deepest first: so no chunk is
        ever less recently used than a chunk below it in its chain, and a recency order gives a chain up
        from its end, leaving a prefix that still matches, never from its head, which would leave every
        chunk below it unreachable while it still takes room. (Paged engines free a request's blocks
        tail first for the same reason; a radix cache evicts leaves only.) `counted`: each is one use
        more (a lookup or a load), or only the order is restored (a put, whose new chunks came in last)."""
        for entry in reversed(entries):
            for tier in self._core.tiers:
                tier.touch(entry.key, counted=counted)
