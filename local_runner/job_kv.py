"""One job's K/V: a buffer per layer sized for the whole job, the restored prefix adopted without a copy.

Why not transformers' DynamicCache: its `update()` concatenates the whole history on every decoded token
(for a 4k-token context that copies ~190 MB per token in float32). A job knows its final length up front
(prompt + max_tokens), so each layer gets one buffer and every step writes into it.

Restoring: kvtier fills layers in order on a background thread, into buffers it sizes for the whole job,
which become this job's buffers on first use of each layer (no second allocation, no copy). Reading a
layer that has not arrived yet waits for it, so when a job runs alone, layer i+1 loads while layer i
computes.

`length` counts the tokens whose K/V every layer holds. A forward writes the new tokens' K/V at
[length, length + n) layer by layer and the step advances `length` only once the whole forward is done,
so a step that fails half-way leaves nothing half-written that counts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvtier import KVLayout

KV = tuple[torch.Tensor, torch.Tensor]


class LayerSource(Protocol):
    """Where restored KV comes from (kvtier.RestoredKV): blocks until layer i is ready."""

    def buffers(self, i: int) -> KV: ...


class JobKV:
    def __init__(
        self,
        layout: KVLayout,
        device: torch.device,
        capacity: int,
        restored: LayerSource | None = None,
        restored_tokens: int = 0,
    ) -> None:
        self._layout = layout
        self._device = device
        self._capacity = max(1, capacity)
        self._source = restored if restored_tokens else None
        self.length = restored_tokens
        self._layers: list[KV | None] = [None] * layout.num_layers

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def nbytes_reserved(self) -> int:
        """Bytes this job's buffers take (or will take) at their current capacity."""
        return self._capacity * self._layout.bytes_per_token

    def layer(self, i: int, needed: int = 0) -> KV:
        """Layer i's whole buffers, [1, heads, capacity, head_dim], with room for `needed` tokens.
        Waits for a restored layer; raises kvtier.KVLoadError if its load failed."""
        kv = self._layers[i]
        if kv is None:
            kv = self._source.buffers(i) if self._source is not None else self._empty(self._capacity)
            self._layers[i] = kv
        if needed > kv[0].shape[-2]:
            kv = self._grow(i, kv, needed)
        return kv

    def write(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> KV:
        """Write K/V of new tokens ([1, heads, n, head_dim]) at [length, length + n) of layer i; returns
        views of that layer's K/V up to length + n (what attention reads)."""
        start = self.length
        end = start + keys.shape[-2]
        kv = self._layers[i]
        if kv is None or end > kv[0].shape[-2]:
            kv = self.layer(i, end)
        k, v = kv
        k[:, :, start:end] = keys
        v[:, :, start:end] = values
        return k[:, :, :end], v[:, :, :end]

    def crop(self, length: int) -> None:
        """Forget every token from `length` on (the buffers stay allocated)."""
        self.length = max(0, min(self.length, length))

    def drop_restored(self) -> None:
        """Start over without the restored prefix (its load failed): an empty job of the same capacity."""
        self._source = None
        self.length = 0
        self._layers = [None] * len(self._layers)

    def layers(self) -> list[KV]:
        """Every layer's K and V for the `length` tokens held, as [1, heads, tokens, head_dim] views."""
        out = []
        for i in range(len(self._layers)):
            k, v = self.layer(i)
            out.append((k[:, :, : self.length], v[:, :, : self.length]))
        return out

    def _empty(self, capacity: int) -> KV:
        lay = self._layout
        shape = (1, lay.num_kv_heads, capacity, lay.head_dim)
        return (
            torch.empty(shape, dtype=lay.dtype, device=self._device),
            torch.empty(shape, dtype=lay.dtype, device=self._device),
        )

    def _grow(self, i: int, kv: KV, needed: int) -> KV:
        self._capacity = max(needed, self._capacity * 2, kv[0].shape[-2] * 2)
        k, v = self._empty(self._capacity)
        k[:, :, : self.length].copy_(kv[0][:, :, : self.length])
        v[:, :, : self.length].copy_(kv[1][:, :, : self.length])
        self._layers[i] = (k, v)
        return k, v
