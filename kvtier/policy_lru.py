"""Least recently used first: the chunk nobody has looked at for longest goes first."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .eviction import Usage
from .schedule import Schedule


class LeastRecentlyUsed:
    name = "lru"

    def order(self, candidates: Iterable[Usage], schedule: Schedule | None) -> Iterator[str]:
        return (u.key for u in candidates)  # they come least recently used first
