"""Tier names and per-tier byte budgets with LRU order.

A budget is only bookkeeping (which keys, how many bytes, in what recency order); the tensors live on
the index entry. Keeping the two apart lets L0, L1 and L2 share one budget class, and lets placement
decide what eviction means (demote, drop, delete a file).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from .tier_names import MEMORY_TIERS, TIERS, Tier

__all__ = ["MEMORY_TIERS", "TIERS", "Tier", "TierBudget"]


class TierBudget:
    """Keys held by one tier with their byte sizes, in LRU order (oldest first); never above capacity."""

    def __init__(self, name: Tier, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{name} capacity must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity = capacity_bytes
        self.used = 0
        self.evictions = 0
        self._lru: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def lru_keys(self) -> list[str]:
        """Keys, least recently used first."""
        return list(self._lru)

    def add(self, key: str, nbytes: int) -> None:
        """Record a key; the caller made room first (see victims)."""
        if key in self._lru:
            raise KeyError(f"{key} already in {self.name}")
        if self.used + nbytes > self.capacity:
            raise RuntimeError(f"{self.name} over capacity: {self.used} + {nbytes} > {self.capacity}")
        self._lru[key] = nbytes
        self.used += nbytes

    def remove(self, key: str) -> bool:
        nbytes = self._lru.pop(key, None)
        if nbytes is None:
            return False
        self.used -= nbytes
        return True

    def touch(self, key: str) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def victims(
        self,
        nbytes: int,
        evictable: Callable[[str], bool],
        order: Callable[[Iterable[str]], list[str]] | None = None,
    ) -> list[str] | None:
        """Keys to remove so that `nbytes` more fit, or None if that is impossible (nothing removed).
        They are taken in `order(keys in LRU order)` (default: least recently used first)."""
        if nbytes > self.capacity:
            return None
        need = self.used + nbytes - self.capacity
        if need <= 0:
            return []
        chosen: list[str] = []
        for key in order(self._lru) if order is not None else self._lru:
            if need <= 0:
                break
            if evictable(key):
                chosen.append(key)
                need -= self._lru[key]
        return chosen if need <= 0 else None
