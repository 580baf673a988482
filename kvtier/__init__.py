"""kvtier: a tiered (device / host / disk) store of multi-turn attention KV chunks.

Knows tensors and files only. See store.KVStore for the API the runner uses.

The names are imported on first use (PEP 562), so `from kvtier import TIERS, Tier` (or importing
`kvtier.tier_names`) loads no torch: the proxy takes the tier names from here without paying for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import ChunkRef, PrefixMatch, StoreConfig
    from .layout import KVLayout
    from .pressure import available_device_memory_bytes, available_memory_bytes
    from .restored_kv import KVLoadError, PagedTarget, RestoredKV
    from .schedule import Schedule
    from .stats import StoreStats, TierStats
    from .store import KVStore
    from .tier_names import MEMORY_TIERS, TIERS, Tier

# Exported name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "ChunkRef": ".config",
    "PrefixMatch": ".config",
    "StoreConfig": ".config",
    "KVLayout": ".layout",
    "available_device_memory_bytes": ".pressure",
    "available_memory_bytes": ".pressure",
    "KVLoadError": ".restored_kv",
    "PagedTarget": ".restored_kv",
    "RestoredKV": ".restored_kv",
    "Schedule": ".schedule",
    "StoreStats": ".stats",
    "TierStats": ".stats",
    "KVStore": ".store",
    "MEMORY_TIERS": ".tier_names",
    "TIERS": ".tier_names",
    "Tier": ".tier_names",
}

__all__ = [
    "MEMORY_TIERS",
    "TIERS",
    "ChunkRef",
    "KVLayout",
    "KVLoadError",
    "KVStore",
    "PagedTarget",
    "PrefixMatch",
    "RestoredKV",
    "Schedule",
    "StoreConfig",
    "StoreStats",
    "Tier",
    "TierStats",
    "available_device_memory_bytes",
    "available_memory_bytes",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
