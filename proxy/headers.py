"""The X-AttentionStore-* response headers every chat completion carries (local or upstream)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeAlias

if TYPE_CHECKING:  # the tier names are kvtier's (importing kvtier at run time would load torch)
    from kvtier import Tier

# What a turn reports as its cache level: the slowest tier it reused KV from, "miss" (a local turn that
# reused nothing) or "bypass" (an upstream turn).
CacheLevel: TypeAlias = "Tier | Literal['miss', 'bypass']"
RouteName = Literal["local", "upstream"]

CACHE = "X-AttentionStore-Cache"
ROUTE = "X-AttentionStore-Route"
REUSED = "X-AttentionStore-Reused-Tokens"
SESSION = "X-AttentionStore-Session"
TTFT = "X-AttentionStore-TTFT-Ms"


def cache_label(level: CacheLevel) -> str:
    """The X-AttentionStore-Cache value (and log and metrics label): `<tier>_hit`, `miss` or `bypass`."""
    return level if level in ("miss", "bypass") else f"{level}_hit"


def store_headers(
    *, cache: CacheLevel, route: RouteName, reused: int, session: str, ttft_ms: float
) -> dict[str, str]:
    """The five headers as a dict, ready for `web.Response(headers=...)` or `resp.headers.update(...)`."""
    return {
        CACHE: cache_label(cache),
        ROUTE: route,
        REUSED: str(int(reused)),
        SESSION: session,
        TTFT: f"{ttft_ms:.2f}",
    }
