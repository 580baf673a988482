"""What the runner's queue says about stored chunks, and the eviction order that follows from it.

AttentionStore's scheduler-aware eviction: the serving queue is a forecast. Chunks that running jobs
need, or that the jobs inside the look-ahead window will need, are not evicted until their job starts
or is cancelled. Among the rest, chunks no queued job needs go first (least recently used first), then
those of queued jobs from the back of the queue, so what is needed soonest stays longest.

ScheduleAware is that order as an eviction policy wrapped around the configured one (which orders the
unscheduled chunks, and each queued job's chunks among themselves).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from .eviction import EvictionPolicy, Usage


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
    chunks from the back of the queue; protected ones never."""
    keys = list(keys_in_order)
    if schedule is None:
        return keys
    free = [k for k in keys if k not in schedule.protected and k not in schedule.queued]
    queued = [k for k in keys if k in schedule.queued]
    queued.sort(key=lambda k: schedule.queued[k], reverse=True)  # stable: LRU among one job's chunks
    return free + queued


class ScheduleAware:
    """An eviction policy that follows the runner's queue: `inner` orders the candidates, then
    eviction_order reorders them by the schedule (without one, `inner`'s order stands)."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.name = inner.name

    def order(self, candidates: Iterable[Usage], schedule: Schedule | None) -> Iterator[str]:
        keys = self.inner.order(candidates, schedule)
        return keys if schedule is None else iter(eviction_order(keys, schedule))
