"""The X-AttentionStore-* headers: the names, and the values every chat completion carries (local or upstream).

`proxy.turns.turn.Turn` is what sets them on an answer; `store_headers` only formats them."""

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
TIERS = "X-AttentionStore-Tiers"
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


def store_headers(
    *,
    cache: CacheLevel,
    route: RouteName,
    reused: int,
    session: str,
    ttft_ms: float,
    replica: str,
    tiers: Mapping[str, int] | None = None,
    position_shift: int | None = None,
    skipped: int | None = None,
) -> dict[str, str]:
    """The X-AttentionStore-* headers as a dict, ready for `web.Response(headers=...)`. Local turns
    also give `tiers` (reused tokens per tier), `position_shift` and `skipped`."""
    headers = {
        CACHE: cache_label(cache),
        ROUTE: route,
        REUSED: str(int(reused)),
        SESSION: session,
        TTFT: f"{ttft_ms:.2f}",
        REPLICA: replica,
    }
    if tiers is not None:
        headers[TIERS] = tiers_value(tiers)
    if position_shift is not None:
        headers[POSITION_SHIFT] = str(int(position_shift))
    if skipped is not None:
        headers[SKIPPED] = str(int(skipped))
    return headers
