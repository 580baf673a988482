"""Layer-wise restore: a background thread assembles each layer's K and V from the match's chunks, in
layer order, so the runner can compute layer i while layer i+1 is still being read from disk.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .disk import ChunkMeta, ChunkReader
from .layout import KVLayout
from .tiers import ChunkKV


class KVLoadError(Exception):
    """A matched chunk could not be restored (gone, unreadable, or failing its checksum); recompute."""


@dataclass
class PlanItem:
    """One chunk of a load: read from memory (`mem`) or from its L2 file (`path` + `meta`)."""

    key: str
    n_tokens: int
    mem: ChunkKV | None = None
    path: Path | None = None
    meta: ChunkMeta | None = None


class LoadFailure(Exception):
    def __init__(self, item: PlanItem, cause: BaseException) -> None:
        super().__init__(f"chunk {item.key}: {cause}")
        self.item = item
        self.cause = cause


class RestoredKV:
    """The handle load() returns; layer(i) blocks until layer i is ready."""

    def __init__(self, num_tokens: int, layout: KVLayout, device: torch.device) -> None:
        self.num_tokens = num_tokens
        self._layout = layout
        self._device = device
        n = layout.num_layers
        self._k: list[torch.Tensor | None] = [None] * n
        self._v: list[torch.Tensor | None] = [None] * n
        self._ready = [threading.Event() for _ in range(n)]
        self._error: KVLoadError | None = None
        self._settled = threading.Event()  # set once the store's bookkeeping (promotion, unpinning) is done
        # Outputs are allocated here, in the caller's thread: memory from a worker thread's malloc arena is
        # returned to the OS after each load and page-faulted in again (measured ~10x slower on CPU).
        shape = (1, layout.num_kv_heads, num_tokens, layout.head_dim)
        self._out = [
            (
                torch.empty(shape, dtype=layout.dtype, device=device),
                torch.empty(shape, dtype=layout.dtype, device=device),
            )
            for _ in range(n)
        ]
        if num_tokens == 0:
            for i in range(n):
                self._set(i, *self._out[i])
            self._settled.set()

    def _set(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._k[i], self._v[i] = k, v
        self._ready[i].set()

    def _fail(self, error: KVLoadError) -> None:
        self._error = error
        for ev in self._ready:
            ev.set()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i, each [1, heads, num_tokens, head_dim]; raises KVLoadError on failure."""
        self._ready[i].wait()
        k, v = self._k[i], self._v[i]
        if k is None or v is None:
            assert self._error is not None
            raise self._error
        return k, v

    def wait(self) -> None:
        """Block until every layer is loaded and the store has promoted the chunks; raises KVLoadError
        if any chunk failed."""
        for ev in self._ready:
            ev.wait()
        self._settled.wait()
        if self._error is not None:
            raise self._error

    @property
    def done(self) -> bool:
        return all(ev.is_set() for ev in self._ready)


def run_load(plan: list[PlanItem], restored: RestoredKV, layout: KVLayout, device: torch.device) -> dict:
    """Fill `restored` layer by layer. Returns {key: ChunkKV} of the chunks read from disk (to promote).

    Raises LoadFailure naming the first chunk that could not be read.
    """
    readers: dict[str, ChunkReader] = {}
    from_disk: dict[str, ChunkKV] = {}
    try:
        for item in plan:
            if item.mem is None:
                assert item.path is not None and item.meta is not None
                try:
                    readers[item.key] = ChunkReader(item.path, item.meta)
                except Exception as e:
                    raise LoadFailure(item, e) from e
                from_disk[item.key] = ChunkKV([], [])
        for i in range(layout.num_layers):
            parts_k, parts_v = [], []
            for item in plan:
                if item.mem is not None:
                    k, v = item.mem.k[i], item.mem.v[i]
                else:
                    try:
                        k, v = readers[item.key].layer(i)
                    except Exception as e:
                        raise LoadFailure(item, e) from e
                    from_disk[item.key].k.append(k)
                    from_disk[item.key].v.append(v)
                parts_k.append(k[:, : item.n_tokens].to(device, non_blocking=True))
                parts_v.append(v[:, : item.n_tokens].to(device, non_blocking=True))
            out_k, out_v = restored._out[i]
            torch.cat(parts_k, dim=1, out=out_k[0])
            torch.cat(parts_v, dim=1, out=out_v[0])
            restored._set(i, out_k, out_v)
    finally:
        for r in readers.values():
            r.close()
    return from_disk
