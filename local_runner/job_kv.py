"""One job's K/V: the pages it holds in its model's pool (kv_pages.py), the restored prefix already in place.

A job takes pages as it grows (`ensure`, before each step writes), so a long prompt and a short one share
one pool; every step writes the new tokens' K/V into the job's pages and nothing is ever copied to grow.

Restoring: kvtier fills the job's first pages layer by layer on its own thread (`load(out=PagedTarget)`,
chunk j into page j). Reading a layer that has not arrived yet waits for it (`layer_ready`), so when a
job runs alone, layer i+1 loads while layer i computes. A positional shift (realign.ShiftedKV) moves a
layer's kept turns on first use.

`length` counts the tokens whose K/V every layer holds. A forward writes the new tokens' K/V at
[length, length + n) layer by layer and the step advances `length` only once the whole forward is done,
so a step that fails half-way leaves nothing half-written that counts.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from kvtier import KVLayout, PagedTarget

from .kv_pages import PagePool

KV = tuple[torch.Tensor, torch.Tensor]

_ids = itertools.count()


class LayerSource(Protocol):
    """Where restored KV comes from (kvtier.RestoredKV, or a shift over it): blocks until layer i is in
    the job's pages (raises kvtier.KVLoadError if it could not be read)."""

    def wait_layer(self, i: int) -> None: ...

    @property
    def ready(self) -> bool:
        """Every layer in place: wait_layer waits for no load."""
        ...


class JobKV:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.id = next(_ids)  # orders a step's jobs (older first); never reused
        self.pages: list[int] = []
        self.length = 0
        self._source: LayerSource | None = None
        self._arrived: list[bool] = []
        self._read_until: torch.cuda.Event | None = None  # a save reads the pages until then (CUDA)

    @classmethod
    def standalone(
        cls, layout: KVLayout, device: torch.device, capacity: int, page_tokens: int = 256
    ) -> JobKV:
        """A job's KV in a pool of its own, room for `capacity` tokens: references, tests, the warm-up."""
        pool = PagePool(layout, device, max(1, -(-capacity // page_tokens)), page_tokens)
        kv = cls(pool)
        kv.ensure(capacity)
        return kv

    # ---- pages --------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Tokens the pages held now have room for."""
        return len(self.pages) * self.pool.page_tokens

    def ensure(self, tokens: int) -> None:
        """Hold pages for `tokens` tokens (kv_pages.PoolExhausted, with nothing taken, if the pool is
        short)."""
        missing = self.pool.pages_for(tokens) - len(self.pages)
        if missing > 0:
            self.pages.extend(self.pool.allocate(missing))

    def read_until(self, event: torch.cuda.Event) -> None:
        """The store still reads these pages on a stream of its own until `event` (a save's copies to
        the host): whoever takes them next waits for it (PagePool.allocate)."""
        self._read_until = event

    def release(self) -> None:
        """Give every page back (the job is done and nothing writes into them any more)."""
        pages, self.pages = self.pages, []
        read_until, self._read_until = self._read_until, None
        self.length = 0
        self._source = None
        self.pool.free(pages, read_until=read_until)

    def reset(self) -> None:
        """Forget the KV held (its pages stay the job's, to be written again)."""
        self.length = 0
        self._source = None

    # ---- restore ------------------------------------------------------------------------------------

    def restore_target(self, tokens: int) -> PagedTarget:
        """Where the store restores `tokens` tokens of stored chunks: chunk j into this job's page j."""
        self.ensure(tokens)
        return PagedTarget(self.pool.buffer, tuple(self.pages[: self.pool.pages_for(tokens)]))

    def restoring_from(self, source: LayerSource, tokens: int) -> None:
        """The first `tokens` tokens arrive from `source`, layer by layer."""
        self._source = source
        self._arrived = [False] * self.num_layers
        self.length = tokens

    @property
    def num_layers(self) -> int:
        return self.pool.layout.num_layers

    @property
    def restoring(self) -> bool:
        """Some restored layer has not been read yet (reading it waits for its load)."""
        return self._source is not None and not all(self._arrived)

    def layer_ready(self, i: int) -> None:
        """Wait until layer i's restored KV is in the pages (kvtier.KVLoadError if its load failed)."""
        if self._source is not None and not self._arrived[i]:
            self._source.wait_layer(i)
            self._arrived[i] = True

    # ---- reading and writing ------------------------------------------------------------------------

    def page_table(self) -> list[int]:
        return list(self.pages)

    def token_slots(self, start: int, end: int) -> tuple[list[int], list[int]]:
        """(page, offset) of each token in [start, end)."""
        size = self.pool.page_tokens
        pages = self.pages
        return [pages[t // size] for t in range(start, end)], [t % size for t in range(start, end)]

    def write(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> KV:
        """Write K/V of new tokens ([1, heads, n, head_dim]) at [length, length + n) of layer i; returns
        layer i's K/V up to length + n as contiguous [1, heads, tokens, head_dim] copies (for the
        transformers forward of models that take the per-job step; the packed step reads pages)."""
        start = self.length
        end = start + keys.shape[-2]
        self.ensure(end)
        self.layer_ready(i)
        k_pages, v_pages = self.pool.layer(i)
        pages, offsets = self._index(start, end, keys.device)
        k_pages[pages, :, offsets] = keys[0].transpose(0, 1)
        v_pages[pages, :, offsets] = values[0].transpose(0, 1)
        return self.gather(i, end)

    def gather(self, i: int, tokens: int) -> KV:
        """Layer i's first `tokens` tokens as contiguous [1, heads, tokens, head_dim] tensors (copies)."""
        self.layer_ready(i)
        k_pages, v_pages = self.pool.layer(i)
        n = self.pool.pages_for(tokens)
        index = torch.tensor(self.pages[:n], dtype=torch.long, device=k_pages.device)
        out = []
        for pages in (k_pages, v_pages):
            held = pages.index_select(0, index)  # [n, heads, page_tokens, dim]
            joined = held.transpose(0, 1).reshape(held.shape[1], -1, held.shape[3])[:, :tokens]
            out.append(joined.unsqueeze(0))
        return out[0], out[1]

    def _index(self, start: int, end: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pages, offsets = self.token_slots(start, end)
        return (
            torch.tensor(pages, dtype=torch.long, device=device),
            torch.tensor(offsets, dtype=torch.long, device=device),
        )

    def layers(self) -> list[KV]:
        """Every layer's K and V of the tokens held, as contiguous [1, heads, tokens, head_dim] copies
        (references and tests; the step reads pages)."""
        return [self.gather(i, self.length) for i in range(self.num_layers)]

    def crop(self, length: int) -> None:
        """Forget every token from `length` on (the pages stay held)."""
        self.length = max(0, min(self.length, length))

    def chunk_blocks(self, tokens: int | None = None) -> list[torch.Tensor]:
        """The KV of the first `tokens` tokens (default: all held) as chunk-shaped views of its pages,
        [layers, 2, heads, n, head_dim] each, n = page_tokens but the last: what the store saves."""
        tokens = self.length if tokens is None else tokens
        for i in range(self.num_layers):
            self.layer_ready(i)
        size = self.pool.page_tokens
        return [
            self.pool.page(p)[:, :, :, : min(size, tokens - j * size)]
            for j, p in enumerate(self.pages[: self.pool.pages_for(tokens)])
        ]

    def copy_from(self, source: JobKV, tokens: int) -> None:
        """The first `tokens` tokens of another job's KV in the same pool (n > 1: one prompt, several
        answers), page by page."""
        self.ensure(tokens)
        buf = self.pool.buffer
        for j in range(self.pool.pages_for(tokens)):
            buf[:, self.pages[j]].copy_(buf[:, source.pages[j]])
        self.length = tokens
