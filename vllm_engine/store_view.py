"""The store of a vLLM server, seen from attnstore's threads: its stats, forgetting and retaining a
session.

All are blocking socket calls (the proxy runs them off its event loop, as it does the embedded
runner's). A store that does not answer (vLLM gone, or started without the store) reads as no stats
and nothing forgotten or retained, never as an error of the endpoint.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier import StoreStats, TierStats

from .link.wire import StoreError, StoreUnavailable
from .server import VllmServer

log = logging.getLogger("attnstore")


def stats_from_dict(raw: dict[str, Any]) -> StoreStats:
    """StoreStats as its to_dict() gave it (the socket carries JSON)."""
    tiers = {name: TierStats(**values) for name, values in raw["tiers"].items()}
    return StoreStats(**{**raw, "tiers": tiers})


def store_stats(server: VllmServer) -> StoreStats | None:
    if server.store is None:
        return None
    try:
        return stats_from_dict(server.store.call("stats"))
    except (StoreUnavailable, StoreError) as exc:
        log.warning("attnstore: the store of vLLM for %s did not answer: %s", server.name, exc)
        return None


def forget(server: VllmServer, tenant: str, session: str) -> int:
    """Drop the session from the store's tiers; vLLM's own cache drops its blocks before it schedules
    its next request (the connector learns of it with that request's lookup)."""
    if server.store is None:
        return 0
    try:
        return int(server.store.call("forget", namespace=tenant, session=session))
    except (StoreUnavailable, StoreError) as exc:
        log.warning("attnstore: the store of vLLM for %s did not answer: %s", server.name, exc)
        return 0


def retain(server: VllmServer, tenant: str, session: str, seconds: float) -> None:
    """Keep the session in the store's memory (its L1: vLLM's own KV memory plays L0) for `seconds`."""
    if server.store is None:
        return
    try:
        server.store.call("retain", namespace=tenant, session=session, seconds=seconds)
    except (StoreUnavailable, StoreError) as exc:
        log.warning("attnstore: the store of vLLM for %s did not answer: %s", server.name, exc)
