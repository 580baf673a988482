"""What the runner's queue says about stored chunks, and the eviction order that follows from it.

AttentionStore's scheduler-aware eviction: the serving queue is a forecast. Chunks that running jobs
need, or that the jobs inside the look-ahead window will need, are not evicted until their job starts
or is cancelled. Among the rest, chunks no queued job needs go first (in the tier policy's order), then
those of queued jobs from the back of the queue, so what is needed soonest stays longest.

eviction_order is the one place that applies it: a tier (tier_interface.py) passes its policy's order
through it. This module knows no policy, so eviction.py and this one do not import each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Schedule:
    """A snapshot the runner hands the store whenever its queue changes."""

    protected: frozenset[str] = frozenset()  # running jobs' and look-ahead window jobs' chunks
    queued: Mapping[str, int] = field(default_factory=dict)  # other queued jobs' chunks: queue position

    @staticmethod
    def from_queue(running: Iterable[Iterable[str]], queue: Iterable[Iterable[str]], window: int) -> Schedule:
        """`running`: chunk keys of each running job; `queue`: of each queued job, head first."""
        protected: set[str] = set()
        for keys in running:
            protected.update(keys)
        queued: dict[str, int] = {}
        for position, keys in enumerate(queue):
            if position < window:
                protected.update(keys)
            else:
                for key in keys:
                    queued.setdefault(key, position)
        return Schedule(frozenset(protected), {k: p for k, p in queued.items() if k not in protected})


def eviction_order(keys_in_order: Iterable[str], schedule: Schedule | None) -> list[str]:
    """Candidates (given in a policy's order, e.g. least recently used first) in the order they should
    go: without a schedule, as given; with one, unscheduled chunks (in the given order), then queued
    chunks from the back of the queue; protected ones never (nowhere else leaves them out)."""
    keys = list(keys_in_order)
    if schedule is None:
        return keys
    evictable = [k for k in keys if k not in schedule.protected]
    free = [k for k in evictable if k not in schedule.queued]
    queued = [k for k in evictable if k in schedule.queued]
    queued.sort(key=lambda k: schedule.queued[k], reverse=True)  # stable: LRU among one job's chunks
    return free + queued
