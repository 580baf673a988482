"""The tier registry: which backend serves each tier, and the store's ordered tiers built from the
configuration. A new tier is one backend file (a MemoryTier or a PersistentTier subclass with a
`from_config`), its name in tier_names.py, and its line in BACKENDS.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .config import StoreConfig
from .file_tier import FileTier
from .layout import KVLayout
from .memory_tier import DeviceTier, HostTier
from .tier_interface import TierBackend
from .tier_names import MEMORY_TIERS, TIERS, Tier

__all__ = ["BACKENDS", "MEMORY_TIERS", "TIERS", "Tier", "TierFactory", "build_tiers"]

TierFactory = Callable[[StoreConfig, KVLayout, str], TierBackend]
"""Builds one tier from the store's configuration, layout and model fingerprint."""

BACKENDS: dict[Tier, TierFactory] = {
    "l0": DeviceTier.from_config,
    "l1": HostTier.from_config,
    "l2": FileTier.from_config,
}


def build_tiers(
    config: StoreConfig,
    layout: KVLayout,
    model_fingerprint: str,
    overrides: Mapping[Tier, TierFactory] | None = None,
) -> list[TierBackend]:
    """Every tier, fastest first; `overrides` replaces the registered backend of some tiers (a test's
    own backend, another kind of store for the same level)."""
    factories = {**BACKENDS, **(overrides or {})}
    return [factories[name](config, layout, model_fingerprint) for name in TIERS]
