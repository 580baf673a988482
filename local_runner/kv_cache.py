"""A transformers cache for one job: preallocated, and optionally restored layer by layer.

Why not a plain DynamicCache: its `update()` concatenates the whole history on every decoded token (for a
4k-token context that copies ~190 MB per token in float32). A job knows its final length up front
(prompt + max_tokens), so each layer gets one buffer and `update()` writes into it.

Restoring: the KV store's loader fills layers in order on a background thread, into buffers it sizes
for the whole job, which the cache then adopts (no second allocation, no copy). A layer that has not
arrived yet reports its length already (so masks and positions are right) and waits for its data in
`update()`, which the model calls at that layer's attention: layer i+1 loads while layer i computes.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class LayerSource(Protocol):
    """Where restored KV comes from (kvtier.RestoredKV): blocks until layer i is ready."""

    capacity: int

    def buffers(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class PreallocatedLayer(DynamicLayer):
    """One layer's K/V in a buffer sized for the whole job; the restored prefix is copied in lazily."""

    def __init__(self, index: int, capacity: int, restored: LayerSource | None, restored_tokens: int):
        super().__init__()
        self._index = index
        self._capacity = capacity
        self._source = restored if restored_tokens else None
        self._length = restored_tokens
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    def get_seq_length(self) -> int:
        return self._length

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.lazy_initialization(key_states, value_states)
        if self._source is not None:
            # The store restored into buffers sized for this job: they become the cache, no copy.
            self._key_buf, self._value_buf = self._source.buffers(self._index)
            self._capacity = self._key_buf.shape[-2]
            self._source = None
            return
        batch, heads, _, head_dim = key_states.shape
        shape = (batch, heads, self._capacity, head_dim)
        self._key_buf = torch.empty(shape, dtype=key_states.dtype, device=key_states.device)
        self._value_buf = torch.empty(shape, dtype=value_states.dtype, device=value_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._key_buf is None:
            self._allocate(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        if end > self._capacity:
            self._grow(end)
        self._key_buf[:, :, start:end].copy_(key_states)
        self._value_buf[:, :, start:end].copy_(value_states)
        self._length = end
        self.keys = self._key_buf[:, :, :end]
        self.values = self._value_buf[:, :, :end]
        return self.keys, self.values

    def _grow(self, needed: int) -> None:
        self._capacity = max(needed, self._capacity * 2)
        for name in ("_key_buf", "_value_buf"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], self._capacity, old.shape[-1]))
            new[:, :, : self._length].copy_(old[:, :, : self._length])
            setattr(self, name, new)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:
            self._length = max(0, self._length + tokens_to_remove)
            if self._key_buf is not None:
                self.keys = self._key_buf[:, :, : self._length]
                self.values = self._value_buf[:, :, : self._length]

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V for every token fed so far, as [1, heads, tokens, head_dim] views."""
        assert self._key_buf is not None, "layer never ran"
        return self._key_buf[:, :, : self._length], self._value_buf[:, :, : self._length]


def job_cache(
    config, capacity: int, restored: LayerSource | None = None, restored_tokens: int = 0
) -> DynamicCache:
    """A cache of `config.num_hidden_layers` preallocated layers, the first `restored_tokens` from `restored`."""
    cache = DynamicCache(config=config)
    cache.layers = [
        PreallocatedLayer(i, capacity, restored, restored_tokens) for i in range(config.num_hidden_layers)
    ]
    return cache


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [layer.kv() for layer in cache.layers]
