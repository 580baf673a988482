"""The tiers' names, in the one spelling every layer uses (kvtier, the proxy's headers and forwarding,
the runner's reports). Torch-free on purpose: the proxy imports these names without loading torch.

A tier's position in TIERS is its rank: fastest first, and eviction demotes towards the end. A new tier
is named here (its registration, with its backend in tier_registry.py).
"""

from __future__ import annotations

from typing import Literal

Tier = Literal["l0", "l1", "l2"]
"""A tier's name: l0 = the runner's device, l1 = host memory, l2 = disk."""

TIERS: tuple[Tier, ...] = ("l0", "l1", "l2")
"""Fastest first: a tier's position is its rank."""

MEMORY_TIERS: tuple[Tier, ...] = ("l0", "l1")
"""The tiers that hold a chunk's tensors in memory (a chunk is in at most one of them at a time)."""


def tier_rank(tier: Tier) -> int:
    """Lower is faster."""
    return TIERS.index(tier)
