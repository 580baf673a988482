"""Load or recompute: restore only the part of a stored prefix that is cheaper to load than to compute.

CachedAttention's point: a hit that takes longer to load than the model takes to recompute it is a loss
(a large model's KV read from a slow disk, say). The store measures what its loads cost per tier
(kvtier.LoadRates); the engine measures its prefill speed (`PrefillRate`, per model step); before a
job restores, `restore_prefix` keeps the prefix of stored chunks whose loading time, minus the compute
it saves, is least. A tier or a speed not measured yet counts as cheaper to load (the first loads
measure it). What is not restored is recomputed, and the turn says how many stored tokens that was.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from kvtier import PrefixMatch, Tier

# Prompt steps smaller than this say more about a step's fixed costs than about prefill speed.
MIN_MEASURED_TOKENS = 128
SMOOTHING = 0.3


class PrefillRate:
    """Seconds per prefilled token, a moving average over the model's prompt steps (written on the
    worker's thread, read from any)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._per_token: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        rate = seconds / tokens
        with self._lock:
            old = self._per_token
            self._per_token = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate

    @property
    def per_token(self) -> float | None:
        with self._lock:
            return self._per_token


def restore_prefix(
    match: PrefixMatch, load_rates: Mapping[Tier, float], bytes_per_token: int, per_token: float | None
) -> PrefixMatch:
    """The prefix of `match` worth restoring: the one whose loading time minus the prefill it saves is
    least (ties: the longer one). All of it while the prefill speed is unmeasured."""
    if per_token is None or not match.chunks:
        return match
    best, best_cost, cost = len(match.chunks), 0.0, 0.0
    costs = [0.0]
    for chunk in match.chunks:
        rate = load_rates.get(chunk.tier)
        load = chunk.n_tokens * bytes_per_token / rate if rate else 0.0
        cost += load - chunk.n_tokens * per_token
        costs.append(cost)
    best_cost = min(costs)
    best = max(k for k, c in enumerate(costs) if c == best_cost)
    return match if best == len(match.chunks) else match.first(best)
