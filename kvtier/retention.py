"""Retention: sessions the store keeps where they are (the fastest tier they fit) until a deadline, ahead
of idle sessions: an agent waiting on a tool's result comes back in seconds, and a client that said how
long its prompt stays useful (OpenAI's `prompt_cache_retention`, Anthropic's `cache_control.ttl`) asked
for it. Plain LRU gives up exactly those sessions first: they are idle while the tool runs.

The table, (namespace, session) -> a `Hold` with its deadline, is the store's (StoreCore owns one;
written under the store's lock, by `KVStore.retain` and `forget_session`). A session's chunks are those
it stored first (`ChunkId.session`, the tag `forget_session` uses) and every chunk before them in their
chains, up to the root: a system prompt another session stored first is this session's prefix too.

Every tier's eviction order (tier_interface.py) puts retained chunks after every unretained one, and
among retained chunks the earliest deadline goes first (a chunk several holds cover counts with the
latest of their deadlines). So a retained chunk leaves its tier only when the tier would otherwise run
out of room: that breaks its hold, which placement.py counts once per hold and logs. Expired holds drop
out whenever the table is read. This module holds no lock and does no I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .index import Entry, PrefixIndex


@dataclass(eq=False)
class Hold:
    """One session's retention. Written only by Retention (below)."""

    namespace: str
    session: str
    deadline: float  # the Retention clock's time at which the hold expires
    broken: bool = False  # pressure evicted one of its chunks before the deadline (counted once)


class Retention:
    """The retention table and the chunks it covers (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._holds: dict[tuple[str, str], Hold] = {}
        self._version = 0  # bumped on every change of the table: the cached chunk map is stale
        self._cached: tuple[int, int, dict[str, Hold]] | None = None  # (version, index version, map)

    def now(self) -> float:
        return self._clock()

    def retain(self, namespace: str, session: str, seconds: float) -> float:
        """Keep the session until `seconds` from now; a hold already running longer is kept as it is
        (a hold is never shortened: only `release` and expiry end one). Returns the deadline."""
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"retention must be a positive number of seconds, got {seconds!r}")
        deadline = self._clock() + seconds
        hold = self._holds.get((namespace, session))
        if hold is not None and hold.deadline >= deadline:
            return hold.deadline
        self._holds[(namespace, session)] = Hold(namespace, session, deadline)  # a new hold, unbroken
        self._version += 1
        return deadline

    def release(self, namespace: str, session: str) -> bool:
        """End the session's hold (the session is forgotten); whether it had one."""
        if self._holds.pop((namespace, session), None) is None:
            return False
        self._version += 1
        return True

    def holds(self) -> list[Hold]:
        """The holds still running (expired ones dropped first)."""
        self._expire()
        return list(self._holds.values())

    def chunks(self, index: PrefixIndex) -> dict[str, Hold]:
        """Retained chunk keys -> the hold that keeps each (the latest deadline where several do). Cached
        until the table or the index changes."""
        self._expire()
        if not self._holds:
            return {}
        cached = self._cached
        if cached is not None and cached[0] == self._version and cached[1] == index.version:
            return cached[2]
        covered: dict[str, Hold] = {}
        for hold in sorted(self._holds.values(), key=lambda h: h.deadline):  # later deadlines overwrite
            for entry in index.session_entries(hold.namespace, hold.session):
                e: Entry | None = entry
                while e is not None and covered.get(e.key) is not hold:  # up the chain to the root
                    covered[e.key] = hold
                    e = index.get(e.chunk.parent)
        self._cached = (self._version, index.version, covered)
        return covered

    def broke(self, hold: Hold) -> bool:
        """Pressure evicted one of the hold's chunks before its deadline: True the first time (count it
        and say so), False after."""
        if hold.broken or hold.deadline <= self._clock():
            return False
        hold.broken = True
        return True

    def _expire(self) -> None:
        now = self._clock()
        expired = [k for k, h in self._holds.items() if h.deadline <= now]
        for k in expired:
            del self._holds[k]
        if expired:
            self._version += 1


def retention_order(keys_in_order: Iterable[str], retained: Mapping[str, Hold] | None) -> list[str]:
    """Candidates (in the policy's and the schedule's order) in the order they should go: unretained ones
    as given, then retained ones, earliest deadline first (stable: as given among one hold's chunks)."""
    keys = list(keys_in_order)
    if not retained:
        return keys
    free = [k for k in keys if k not in retained]
    held = sorted((k for k in keys if k in retained), key=lambda k: retained[k].deadline)
    return free + held
