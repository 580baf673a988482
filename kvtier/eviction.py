"""The eviction policy interface: in what order a tier gives up its chunks when it must make room.

A policy holds no state. The tier that holds the chunks keeps one Usage record per chunk (tier.py is
its only writer) and, when it must make room, asks its policy to order them. A policy is chosen per
tier by the `eviction` setting; policies.py maps the names to classes (one file per policy).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .schedule import Schedule


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

    def order(self, candidates: Iterable[Usage], schedule: Schedule | None) -> Iterator[str]:
        """The candidates' keys, the first to go first (lazily: a tier stops reading once it has room).
        Candidates come least recently used first. `schedule`: the runner's queue (schedule.py) or
        None; a policy may ignore it (ScheduleAware wraps one that does). A key left out stays."""
        ...
