"""The tier interface: what every tier backend implements (memory_tier.py, file_tier.py), and the byte
budget with eviction order they all share. Which backend serves which tier is tier_registry.py; the
tiers' names are tier_names.py.

    admit(key, nbytes, handle)   take a chunk (the store made room first, see victims)
    read(key) -> handle | None   what a load reads the chunk from
    drop(key) -> handle | None   let a chunk go; the store disposes of the handle it gets back
    scan()                       what the tier already holds when the store starts (disk: its files)
    capacity                     bytes it may hold; `used` never goes above it

Ownership: a tier owns its budget (`capacity`, `used`, `evictions`), one handle per chunk it holds (a
tensor buffer in memory, a file's header on disk), one Usage record per chunk (what its eviction policy
orders) and its clock. Nobody else writes them; the store's index entries (index.py) are not the
tier's to write either: the two meet only by chunk key.

Locking: the store holds its lock around every call of the methods above but `scan`; they never copy a
tensor nor touch a disk. A subclass's I/O methods say so, and the store calls them with its lock
released.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from .eviction import EvictionPolicy, Usage
from .retention import Hold, retention_order
from .schedule import Schedule, eviction_order
from .tier_names import Tier

H = TypeVar("H")


class TierBackend(ABC, Generic[H]):
    """One tier of the store: a byte budget, an eviction policy and a handle of type H per chunk."""

    def __init__(self, name: Tier, capacity_bytes: int, policy: EvictionPolicy) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{name} capacity must be >= 0, got {capacity_bytes}")
        self.name: Tier = name
        self.capacity = capacity_bytes
        self.policy = policy
        self.used = 0
        self.evictions = 0
        self._handles: dict[str, H] = {}
        self._usage: OrderedDict[str, Usage] = OrderedDict()  # the budget, least recently used first
        self._clock = 0

    def __contains__(self, key: str) -> bool:
        """Whether the chunk counts against this tier's budget."""
        return key in self._usage

    def __len__(self) -> int:
        return len(self._usage)

    def held(self) -> list[str]:
        """The chunks that count against this tier's budget (a snapshot)."""
        return list(self._usage)

    # ---- the interface ------------------------------------------------------------------------------

    def admit(self, key: str, nbytes: int, handle: H) -> None:
        """Take a chunk; the caller made room first (victims). Raises if it is held or does not fit."""
        self._charge(key, nbytes)
        self._handles[key] = handle

    def read(self, key: str) -> H | None:
        """The chunk's handle, or None when this tier holds no copy of it."""
        return self._handles.get(key)

    def drop(self, key: str, *, evicted: bool = False) -> H | None:
        """Let the chunk go (counted as an eviction when `evicted`); returns its handle for the store to
        dispose of (None if this tier held none). A key the tier does not hold is a no-op."""
        if key not in self._usage:
            return None
        self._discharge(key)
        if evicted:
            self.evictions += 1
        return self._handles.pop(key, None)

    @abstractmethod
    def scan(self) -> Iterator[object]:
        """Without the store lock: what the tier holds from before the store started."""

    # ---- budget and eviction order --------------------------------------------------------------------

    def touch(self, key: str, *, counted: bool = True) -> None:
        """The chunk was used: most recently used now, and one use more when `counted` (not when only its
        chain's order is restored, Placement.touch_chain)."""
        usage = self._usage.get(key)
        if usage is not None:
            self._clock += 1
            usage.last_used = self._clock
            usage.uses += counted
            self._usage.move_to_end(key)

    def evictable(self, key: str) -> bool:
        """Whether this tier could let the chunk go now (a subclass says no while it writes it)."""
        return True

    def ordered(self, schedule: Schedule | None, retained: Mapping[str, Hold] | None = None) -> list[str]:
        """The keys of every chunk the tier may give up, in the order it would (a list: the caller may
        evict while it walks it). `retained`: the store's retained chunks (retention.py), which go last."""
        return list(self._eviction_order(schedule, retained))

    def victims(
        self,
        nbytes: int,
        evictable: Callable[[str], bool],
        schedule: Schedule | None,
        retained: Mapping[str, Hold] | None = None,
    ) -> list[str] | None:
        """Keys to let go so that `nbytes` more fit, in eviction order (`ordered`), taking only those that
        `evictable` and the tier allow; None if that is impossible (then nothing is to go)."""
        if nbytes > self.capacity:
            return None
        need = self.used + nbytes - self.capacity
        if need <= 0:
            return []
        chosen: list[str] = []
        for key in self._eviction_order(schedule, retained):
            if need <= 0:
                break
            if evictable(key) and self.evictable(key):
                chosen.append(key)
                need -= self._usage[key].nbytes
        return chosen if need <= 0 else None

    def _eviction_order(
        self, schedule: Schedule | None, retained: Mapping[str, Hold] | None = None
    ) -> Iterator[str]:
        """The one place where the schedule and retention meet the policy: the policy's order, then the
        schedule's (protected chunks left out, see schedule.py), then retained chunks moved last,
        earliest deadline first (retention.py). Lazy with neither: victims stops reading once it has
        room."""
        keys = self.policy.order(self._usage.values())
        if schedule is not None:
            keys = iter(eviction_order(keys, schedule))
        if retained:
            keys = iter(retention_order(keys, retained))
        return keys

    def _charge(self, key: str, nbytes: int) -> None:
        if key in self._usage:
            raise KeyError(f"{key} already in {self.name}")
        if self.used + nbytes > self.capacity:
            raise RuntimeError(f"{self.name} over capacity: {self.used} + {nbytes} > {self.capacity}")
        self._clock += 1
        self._usage[key] = Usage(key, nbytes, admitted=self._clock, last_used=self._clock)
        self.used += nbytes

    def _discharge(self, key: str) -> None:
        usage = self._usage.pop(key, None)
        if usage is not None:
            self.used -= usage.nbytes
