"""RestoredKV: the handle a load hands the runner, restored KV arriving layer by layer.

The loader (loading.py, on a load thread) fills it (`target`, `mark_loaded`, `fail`) and the store says
when its own bookkeeping is over (`settle`); the runner reads it (`layer`, `buffers`, `wait`). Layer i
is the runner's to read once it is loaded, so it can compute layer i while layer i+1 still arrives.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import KVLayout


class KVLoadError(Exception):
    """A matched chunk could not be restored (gone, unreadable, or failing its checksum); recompute."""


@dataclass(frozen=True)
class PagedTarget:
    """Restore destinations in a caller's paged pool: chunk j of the match goes into page `pages[j]`.

    `pool` is [layers, pages, 2, kv_heads, page_tokens, head_dim]: page p of layer i, pool[i, p], holds
    K then V of one chunk exactly as a chunk buffer's layer does (ChunkKV), so a chunk's layer arrives in
    one copy. Every chunk of the match but the last must fill its page (page_tokens tokens)."""

    pool: torch.Tensor
    pages: tuple[int, ...]

    @property
    def page_tokens(self) -> int:
        return int(self.pool.shape[4])

    def block(self, i: int, j: int, n: int) -> torch.Tensor:
        """Layer i of chunk j's page, its first n tokens: [2, kv_heads, n, head_dim]."""
        return self.pool[i, self.pages[j], :, :, :n]


class RestoredKV:
    """The handle load() returns; layer(i) blocks until layer i is ready."""

    def __init__(
        self,
        num_tokens: int,
        layout: KVLayout,
        device: torch.device,
        capacity: int | None = None,
        out: Sequence[tuple[torch.Tensor, torch.Tensor]] | PagedTarget | None = None,
    ) -> None:
        self.num_tokens = num_tokens
        # Room for tokens the caller will append (its prompt's rest and answer): the caller can then
        # adopt the buffers as its cache instead of allocating its own and copying the restored KV.
        self.capacity = max(num_tokens, capacity or 0)
        self._layout = layout
        self._device = device
        n = layout.num_layers
        self._k: list[torch.Tensor | None] = [None] * n
        self._v: list[torch.Tensor | None] = [None] * n
        self._ready = [threading.Event() for _ in range(n)]
        self._events: list[torch.cuda.Event | None] = [None] * n
        self._loaded = [False] * n
        self._error: KVLoadError | None = None
        self._settled = threading.Event()  # set once the store's bookkeeping (promotion, unpinning) is done
        self.paged: PagedTarget | None = None
        self._out: list[tuple[torch.Tensor, torch.Tensor]] = []
        if isinstance(out, PagedTarget):
            # Pages of the caller's pool: chunk j into page j, written where the job computes.
            self.paged = _check_paged(out, layout, num_tokens, device)
            self.capacity = len(out.pages) * out.page_tokens
        elif out is not None:
            # The caller's own buffers (a runner's KV slot): the restore writes where the job computes,
            # so nothing is copied again once it has arrived.
            self._out = [_check_target(i, kv, layout, num_tokens, device) for i, kv in enumerate(out)]
            if len(self._out) != n:
                raise ValueError(f"restore targets: {len(self._out)} layers given, the layout has {n}")
            self.capacity = min(int(k.shape[-2]) for k, _ in self._out)
        else:
            # Outputs are allocated here, in the caller's thread: memory from a worker thread's malloc
            # arena is returned to the OS after each load and page-faulted in again (~10x slower on CPU).
            shape = (1, layout.num_kv_heads, self.capacity, layout.head_dim)
            self._out = [
                (
                    torch.empty(shape, dtype=layout.dtype, device=device),
                    torch.empty(shape, dtype=layout.dtype, device=device),
                )
                for _ in range(n)
            ]
        # On CUDA: the caller's stream as the load begins. The loader's copy stream waits on it before it
        # writes the targets: fresh ones are that stream's allocations (their memory may still be read by
        # work queued there before), and the caller's own may still be in use by its earlier work.
        self.targets_free: torch.cuda.Event | None = None
        if device.type == "cuda" and num_tokens > 0:
            self.targets_free = torch.cuda.Event()
            self.targets_free.record(torch.cuda.current_stream(device))
        if num_tokens == 0:
            for i in range(n):
                self.mark_loaded(i)
            self.settle()

    def target(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The loader's side: layer i's output buffers to fill, [1, heads, capacity, head_dim] (no wait);
        not for a paged target (see `paged`)."""
        return self._out[i]

    @property
    def target_tensors(self) -> list[torch.Tensor]:
        """Every tensor the load writes into (a paged target's whole pool)."""
        if self.paged is not None:
            return [self.paged.pool]
        return [t for kv in self._out for t in kv]

    def mark_loaded(self, i: int, copied: torch.cuda.Event | None = None) -> None:
        """The loader's side: layer i's first num_tokens are filled and verified; readers may take them.
        `copied`: on CUDA, the event recorded on the loader's copy stream after layer i's copies; a reader
        makes its own stream wait on it (the GPU waits, not the thread)."""
        self._events[i] = copied
        if self.paged is None:
            self._k[i], self._v[i] = self._out[i]
        self._loaded[i] = True
        self._ready[i].set()

    def fail(self, error: KVLoadError) -> None:
        """The loader's side: the load is over and failed. Wakes every reader of a layer not loaded yet,
        which then raises `error`; layers already handed out stay valid."""
        self._error = error
        for ev in self._ready:
            ev.set()

    def settle(self) -> None:
        """The store's side: its bookkeeping for this load (promotion, unpinning) is done; wait() returns."""
        self._settled.set()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i, each [1, heads, num_tokens, head_dim]; raises KVLoadError on failure."""
        k, v = self.buffers(i)
        n = self.num_tokens
        return k[:, :, :n], v[:, :, :n]

    def buffers(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's whole output buffers, [1, heads, capacity, head_dim], the first num_tokens filled;
        the caller may keep and write past them (they are its own once loaded). Not for a paged target."""
        self.wait_layer(i)
        k, v = self._k[i], self._v[i]
        assert k is not None and v is not None, "a paged restore has no per-layer buffers"
        return k, v

    def wait_layer(self, i: int) -> None:
        """Block until layer i is in its destination (raises KVLoadError if it could not be read). On CUDA
        the caller's current stream waits for the layer's copies (the GPU waits, not the thread)."""
        self._ready[i].wait()
        if not self._loaded[i]:
            assert self._error is not None
            raise self._error
        event = self._events[i]
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def layer_events(self) -> list[torch.cuda.Event | None]:
        """Each layer's copy event (CUDA; timing-enabled: a timeline can place it), None elsewhere."""
        return list(self._events)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until `ready` (or the timeout passes); never raises: `wait()` says how it ended."""
        if not self._settled.wait(timeout):
            return False
        return all(ev.wait(0) for ev in self._ready)

    @property
    def ready(self) -> bool:
        """True once wait() would return at once: every layer loaded (or the load failed) and settled.
        A batching runner keeps a job out of its steps until then, so a step never waits on a disk."""
        return self._settled.is_set() and all(ev.is_set() for ev in self._ready)

    def wait(self) -> None:
        """Block until every layer is loaded and the store has promoted the chunks; raises KVLoadError
        if any chunk failed."""
        for ev in self._ready:
            ev.wait()
        self._settled.wait()
        if self._error is not None:
            raise self._error


def _check_paged(out: PagedTarget, layout: KVLayout, num_tokens: int, device: torch.device) -> PagedTarget:
    """A caller's paged pool must be [layers, pages, 2, heads, page_tokens, head_dim] of the layout's
    dtype on the store's device, each page's rows contiguous, with pages enough for num_tokens."""
    p = out.pool
    ok = (
        p.dim() == 6
        and p.shape[0] == layout.num_layers
        and p.shape[2] == 2
        and p.shape[3] == layout.num_kv_heads
        and p.shape[5] == layout.head_dim
        and p.dtype == layout.dtype
        and p.device == device
        and p.stride(-1) == 1
        and p.stride(-2) == layout.head_dim
        and all(0 <= q < p.shape[1] for q in out.pages)
        and len(out.pages) * out.page_tokens >= num_tokens
    )
    if not ok:
        raise ValueError(f"paged restore target {tuple(p.shape)} {p.dtype} on {p.device} does not fit")
    return out


def _check_target(
    i: int, kv: tuple[torch.Tensor, torch.Tensor], layout: KVLayout, num_tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A caller's layer buffers must be [1, heads, >= num_tokens, head_dim] of the layout's dtype on
    the store's device, each head's tokens contiguous (the loader writes them as plain byte rows)."""
    for t in kv:
        ok = (
            t.dim() == 4
            and t.shape[0] == 1
            and t.shape[1] == layout.num_kv_heads
            and t.shape[2] >= num_tokens
            and t.shape[3] == layout.head_dim
            and t.dtype == layout.dtype
            and t.device == device
            and t.stride(-1) == 1
            and t.stride(-2) == layout.head_dim
        )
        if not ok:
            raise ValueError(
                f"restore target of layer {i}: {tuple(t.shape)} {t.dtype} on {t.device} does not fit"
            )
    return kv
