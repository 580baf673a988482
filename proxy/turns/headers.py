"""The X-AttentionStore-* headers: the names, and the values every chat completion carries (local or upstream).

`proxy.turns.turn.Turn` builds them for an answer (`Turn.headers`); this module names and formats them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypeAlias

from kvtier import tier_names  # torch-free: the tier names only

# What a turn reports as its cache level: the slowest tier it reused KV from, "miss" (a local turn that
# reused nothing) or "bypass" (an upstream turn).
CacheLevel: TypeAlias = tier_names.Tier | Literal["miss", "bypass"]
RouteName = Literal["local", "upstream"]

CACHE = "X-AttentionStore-Cache"
ROUTE = "X-AttentionStore-Route"
REUSED = "X-AttentionStore-Reused-Tokens"
SESSION = "X-AttentionStore-Session"
TTFT = "X-AttentionStore-TTFT-Ms"
TIERS_HEADER = "X-AttentionStore-Tiers"  # (TIERS is kvtier's tuple of tier names)
POSITION_SHIFT = "X-AttentionStore-Position-Shift"
# Stored tokens a local turn recomputed instead of restoring: loading them was measured slower.
SKIPPED = "X-AttentionStore-Skipped-Tokens"
REPLICA = "X-AttentionStore-Replica"
# On a turn one replica forwards to another (one hop at most: a request carrying it is served where it lands).
FORWARDED_BY = "X-AttentionStore-Forwarded-By"
TIER_NAMES = tier_names.TIERS  # X-AttentionStore-Tiers names every tier kvtier has, in its order


def cache_label(level: CacheLevel) -> str:
    """The X-AttentionStore-Cache value (and log and metrics label): `<tier>_hit`, `miss` or `bypass`."""
    return level if level in ("miss", "bypass") else f"{level}_hit"


def tiers_value(tokens_by_tier: Mapping[str, int]) -> str:
    """`l0=<n>,l1=<n>,l2=<n>`: reused tokens from each tier, every tier named."""
    return ",".join(f"{t}={int(tokens_by_tier.get(t, 0))}" for t in TIER_NAMES)
