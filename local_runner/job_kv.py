"""One job's K/V: its slot in the model's KV pool (kv_slots.py), the restored prefix already in place.

A job knows its final length up front (prompt + max_tokens), and its slot has room for the model's whole
context, so every step writes the new tokens' K/V into the slot and nothing is ever reallocated or
concatenated (transformers' DynamicCache copies the whole history on every token).

Restoring: kvtier fills the slot's layers in order on a background thread (`load(out=slot views)`).
Reading a layer that has not arrived yet waits for it, so when a job runs alone, layer i+1 loads while
layer i computes. A positional shift (realign.ShiftedKV) moves a layer's kept turns on first use.

`length` counts the tokens whose K/V every layer holds. A forward writes the new tokens' K/V at
[length, length + n) layer by layer and the step advances `length` only once the whole forward is done,
so a step that fails half-way leaves nothing half-written that counts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvtier import KVLayout

from .kv_slots import KV, SlotPool


class LayerSource(Protocol):
    """Where restored KV comes from (kvtier.RestoredKV, or a shift over it): blocks until layer i is
    ready in the slot, then returns its buffers."""

    def buffers(self, i: int) -> KV: ...


class JobKV:
    def __init__(
        self,
        pool: SlotPool,
        slot: int,
        restored: LayerSource | None = None,
        restored_tokens: int = 0,
    ) -> None:
        self.pool = pool
        self.slot = slot
        self._views = pool.slot_layers(slot)
        self._source = restored if restored_tokens else None
        self._arrived = [self._source is None] * len(self._views)
        self.length = restored_tokens

    @classmethod
    def standalone(cls, layout: KVLayout, device: torch.device, capacity: int) -> JobKV:
        """A job's KV in a pool of its own (one slot): references, tests, the warm-up."""
        return cls(SlotPool(layout, device, 1, max(1, capacity)), 0)

    @property
    def num_layers(self) -> int:
        return len(self._views)

    @property
    def restoring(self) -> bool:
        """Some restored layer has not been read yet (reading it waits for its load)."""
        return self._source is not None and not all(self._arrived)

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def layer(self, i: int) -> KV:
        """Layer i's whole slot, [1, heads, capacity, head_dim] each; waits for a restored layer and
        raises kvtier.KVLoadError if its load failed."""
        if not self._arrived[i]:
            assert self._source is not None
            self._source.buffers(i)  # the restore wrote into this slot; a shift moves it here
            self._arrived[i] = True
        return self._views[i]

    def write(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> KV:
        """Write K/V of new tokens ([1, heads, n, head_dim]) at [length, length + n) of layer i; returns
        views of that layer's K/V up to length + n (what attention reads)."""
        start = self.length
        end = start + keys.shape[-2]
        if end > self.capacity:
            raise ValueError(f"a job's KV cannot grow past its slot ({end} > {self.capacity} tokens)")
        k, v = self.layer(i)
        k[:, :, start:end] = keys
        v[:, :, start:end] = values
        return k[:, :, :end], v[:, :, :end]

    def crop(self, length: int) -> None:
        """Forget every token from `length` on."""
        self.length = max(0, min(self.length, length))

    def layers(self) -> list[KV]:
        """Every layer's K and V for the `length` tokens held, as [1, heads, tokens, head_dim] views."""
        out = []
        for i in range(len(self._views)):
            k, v = self.layer(i)
            out.append((k[:, :, : self.length], v[:, :, : self.length]))
        return out

    def restore_targets(self) -> list[KV]:
        """The slot's per-layer buffers, for the store to restore into (kvtier `load(out=...)`)."""
        return list(self._views)
