"""What restores have cost, per tier: the bandwidth a caller weighs against recomputing the KV.

CachedAttention's point: a hit that takes longer to load than the model takes to recompute it is a loss.
The store measures each load it runs (bytes over the time from its start to its last copy done on the
device) and keeps a moving average per tier, charged to the load's slowest tier (the one it waited on).
The caller (the engine, which knows its prefill speed) decides what to restore (`PrefixMatch.first`).
"""

from __future__ import annotations

import threading

from .tier_names import Tier

# Loads smaller than this say more about fixed costs than about bandwidth: not measured.
MIN_MEASURED_BYTES = 1 << 20
# Weight of a new measurement in the moving average.
SMOOTHING = 0.3


class LoadRates:
    """Bytes per second per tier, measured; thread-safe (load threads write, any thread reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates: dict[Tier, float] = {}

    def observe(self, tier: Tier, nbytes: int, seconds: float) -> None:
        if nbytes < MIN_MEASURED_BYTES or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._rates.get(tier)
            self._rates[tier] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate

    def snapshot(self) -> dict[Tier, float]:
        with self._lock:
            return dict(self._rates)
