"""kvtier: a tiered (device / host / disk) store of multi-turn attention KV chunks.

Knows tensors and files only. See store.KVStore for the API the runner uses.
"""

from .config import ChunkRef, PrefixMatch, StoreConfig
from .layout import KVLayout
from .pressure import available_memory_bytes
from .restore import KVLoadError, RestoredKV
from .schedule import Schedule
from .stats import StoreStats, TierStats
from .store import KVStore
from .tiers import TIERS, Tier

__all__ = [
    "ChunkRef",
    "KVLayout",
    "KVLoadError",
    "KVStore",
    "PrefixMatch",
    "RestoredKV",
    "Schedule",
    "StoreConfig",
    "StoreStats",
    "TIERS",
    "Tier",
    "TierStats",
    "available_memory_bytes",
]
