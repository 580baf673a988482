"""Eviction policies: in what order a tier gives up its chunks when it must make room.

A policy holds no state and knows nothing of the runner's queue. The tier that holds the chunks keeps
one Usage record per chunk (tier_interface.py is its only writer) and, when it must make room, asks its
policy to order them; the runner's schedule (schedule.py) then reorders that order, once, in the tier.
A policy is chosen per tier by the `eviction` setting: a new one is a class with `name` and `order`
here, plus its line in POLICIES.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class Usage:
    """What a tier knows about one chunk it holds. Written only by that tier, read by its policy."""

    key: str
    nbytes: int
    admitted: int  # the tier's clock when the chunk came in
    last_used: int  # the tier's clock at its admission or its latest use
    uses: int = 0  # uses since its admission (a lookup that matched it, a load that read it)


class EvictionPolicy(Protocol):
    """Orders a tier's chunks for eviction."""

    name: str

    def order(self, candidates: Iterable[Usage]) -> Iterator[str]:
        """The candidates' keys, the first to go first (lazily: a tier stops reading once it has room).
        Candidates come least recently used first."""
        ...


class LeastRecentlyUsed:
    """The chunk nobody has looked at for longest goes first."""

    name = "lru"

    def order(self, candidates: Iterable[Usage]) -> Iterator[str]:
        return (u.key for u in candidates)  # they come least recently used first


class LeastFrequentlyUsed:
    """Chunks matched by fewer lookups since they entered the tier go first, the least recently used
    first among equals. It keeps what many turns reuse (a system prompt shared by many sessions, the
    early turns of a long conversation) above a one-off conversation's newer chunks, which plain LRU
    would keep instead."""

    name = "lfu"

    def order(self, candidates: Iterable[Usage]) -> Iterator[str]:
        return (u.key for u in sorted(candidates, key=lambda u: u.uses))  # stable: LRU among equals


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LeastRecentlyUsed,
    "lfu": LeastFrequentlyUsed,
}
"""The policies by the name the `eviction` setting uses."""


def make_policy(name: str) -> EvictionPolicy:
    """The named policy; raises ValueError naming the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {', '.join(POLICIES)}") from None
