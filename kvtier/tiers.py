"""In-memory chunk data and per-tier byte budgets with LRU order.

A tier here is only bookkeeping (which keys, how many bytes, in what recency order); the tensors live
on the index entry. Keeping the two apart lets L0, L1 and L2 share one budget class, and lets the store
decide what eviction means (demote, drop, delete a file).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Literal

import numpy as np
import torch

from .layout import KVLayout

Tier = Literal["l0", "l1", "l2"]
"""A tier's name: l0 = the runner's device, l1 = host memory, l2 = disk (the one spelling everywhere)."""

TIERS: tuple[Tier, ...] = ("l0", "l1", "l2")
"""Fastest first: a tier's position is its rank (eviction demotes towards the end)."""

MEMORY_TIERS: tuple[Tier, ...] = ("l0", "l1")
"""The tiers that hold tensors in memory (placement tries them in this order)."""


def host_bytes(t: torch.Tensor) -> np.ndarray | None:
    """A host tensor's bytes as a uint8 numpy array with the same dimensions (the last one scaled by the
    item size), no copy; None on a device or when the last dimension is not contiguous."""
    if t.device.type != "cpu" or (t.dim() and t.stride(-1) != 1) or t.requires_grad:
        return None
    return t.view(torch.uint8).numpy()


class ChunkKV:
    """K and V of every layer for one chunk, in ONE contiguous buffer [layers, 2, heads, n_tokens, head_dim]
    (K of layer i at buf[i, 0], V at buf[i, 1]). Never mutated once built.

    One buffer means one allocation and one free per chunk, and the L2 file's tensor bytes are exactly
    this buffer's bytes (k.0, v.0, k.1, v.1, ...), so a save is one write and a layer's checksum one pass.
    """

    __slots__ = ("buf",)

    def __init__(self, buf: torch.Tensor) -> None:
        if buf.dim() != 5 or buf.shape[1] != 2 or not buf.is_contiguous():
            raise ValueError(
                f"ChunkKV needs a contiguous [layers, 2, heads, n, dim] buffer, got {tuple(buf.shape)}"
            )
        self.buf = buf

    @classmethod
    def empty(cls, layout: KVLayout, n_tokens: int, device: torch.device, *, pin: bool = False) -> ChunkKV:
        shape = (layout.num_layers, 2, layout.num_kv_heads, n_tokens, layout.head_dim)
        return cls(torch.empty(shape, dtype=layout.dtype, device=device, pin_memory=pin))

    @property
    def num_layers(self) -> int:
        return self.buf.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.buf.shape[3]

    def host_bytes(self) -> np.ndarray | None:
        """The buffer as a uint8 numpy array [layers, 2, heads, n, head_dim * itemsize] (no copy), or None
        off the host. numpy copies of these slices are memcpy-speed (torch's strided copy_ is ~2x slower
        here), and uint8 covers every dtype, bfloat16 included."""
        return host_bytes(self.buf)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i, each a [heads, n_tokens, head_dim] view."""
        kv = self.buf[i]
        return kv[0], kv[1]

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    def to(self, device: torch.device, *, pin: bool = False) -> ChunkKV:
        """Copy to `device` (no copy if already there); pinned host memory when asked and possible."""
        if self.buf.device == device:
            return self
        out = torch.empty_like(self.buf, device=device, pin_memory=pin and device.type == "cpu")
        out.copy_(self.buf)
        return ChunkKV(out)


class TierBudget:
    """Keys held by one tier with their byte sizes, in LRU order (oldest first); never above capacity."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{name} capacity must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity = capacity_bytes
        self.used = 0
        self.evictions = 0
        self._lru: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> Iterator[str]:
        return iter(list(self._lru))

    def add(self, key: str, nbytes: int) -> None:
        """Record a key; the caller made room first (see victims)."""
        if key in self._lru:
            raise KeyError(f"{key} already in {self.name}")
        if self.used + nbytes > self.capacity:
            raise RuntimeError(f"{self.name} over capacity: {self.used} + {nbytes} > {self.capacity}")
        self._lru[key] = nbytes
        self.used += nbytes

    def remove(self, key: str) -> bool:
        nbytes = self._lru.pop(key, None)
        if nbytes is None:
            return False
        self.used -= nbytes
        return True

    def touch(self, key: str) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def victims(self, nbytes: int, evictable: Callable[[str], bool]) -> list[str] | None:
        """LRU keys to remove so that `nbytes` more fit, or None if that is impossible (nothing removed)."""
        if nbytes > self.capacity:
            return None
        need = self.used + nbytes - self.capacity
        chosen: list[str] = []
        for key, size in self._lru.items():
            if need <= 0:
                break
            if evictable(key):
                chosen.append(key)
                need -= size
        return chosen if need <= 0 else None
