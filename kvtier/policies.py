"""The eviction policies by the name the `eviction` setting uses. A new policy is one file (a class
with `name` and `order`, see eviction.py) plus its line here."""

from __future__ import annotations

from collections.abc import Callable

from .eviction import EvictionPolicy
from .policy_lfu import LeastFrequentlyUsed
from .policy_lru import LeastRecentlyUsed
from .schedule import ScheduleAware

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LeastRecentlyUsed,
    "lfu": LeastFrequentlyUsed,
}


def make_policy(name: str) -> EvictionPolicy:
    """The named policy, within the scheduler's order (ScheduleAware: a tier follows the runner's
    queue whenever the runner hands the store one)."""
    try:
        policy = POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {', '.join(POLICIES)}") from None
    return ScheduleAware(policy)
