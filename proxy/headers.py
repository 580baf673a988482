"""The X-AttentionStore-* response headers every chat completion carries (local or upstream)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Literal

Cache = Literal["l0_hit", "l1_hit", "l2_hit", "miss", "bypass"]
RouteName = Literal["local", "upstream"]

CACHE = "X-AttentionStore-Cache"
ROUTE = "X-AttentionStore-Route"
REUSED = "X-AttentionStore-Reused-Tokens"
SESSION = "X-AttentionStore-Session"
TTFT = "X-AttentionStore-TTFT-Ms"


def store_headers(
    *, cache: Cache, route: RouteName, reused: int, session: str, ttft_ms: float
) -> dict[str, str]:
    """The five headers as a dict, ready for `web.Response(headers=...)` or `resp.headers.update(...)`."""
    return {
        CACHE: cache,
        ROUTE: route,
        REUSED: str(int(reused)),
        SESSION: session,
        TTFT: f"{ttft_ms:.2f}",
    }


def apply_store_headers(
    target: MutableMapping[str, str],
    *,
    cache: Cache,
    route: RouteName,
    reused: int,
    session: str,
    ttft_ms: float,
) -> None:
    """Set the headers on a response's header map (before `prepare()` for a StreamResponse)."""
    target.update(store_headers(cache=cache, route=route, reused=reused, session=session, ttft_ms=ttft_ms))
