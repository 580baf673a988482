"""Least frequently used first: chunks matched by fewer lookups since they entered the tier go first,
the least recently used first among equals. It keeps what many turns reuse (a system prompt shared by
many sessions, the early turns of a long conversation) above a one-off conversation's newer chunks,
which plain LRU would keep instead."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .eviction import Usage
from .schedule import Schedule


class LeastFrequentlyUsed:
    name = "lfu"

    def order(self, candidates: Iterable[Usage], schedule: Schedule | None) -> Iterator[str]:
        return (u.key for u in sorted(candidates, key=lambda u: u.uses))  # stable: LRU among equals
