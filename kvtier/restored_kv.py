"""RestoredKV: the handle a load hands the runner, restored KV arriving layer by layer.

The loader (loading.py, on a load thread) fills it (`target`, `mark_loaded`, `fail`) and the store says
when its own bookkeeping is over (`settle`); the runner reads it (`layer`, `buffers`, `wait`). Layer i
is the runner's to read once it is loaded, so it can compute layer i while layer i+1 still arrives.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .layout import KVLayout


class KVLoadError(Exception):
    """A matched chunk could not be restored (gone, unreadable, or failing its checksum); recompute."""


class RestoredKV:
    """The handle load() returns; layer(i) blocks until layer i is ready."""

    def __init__(
        self,
        num_tokens: int,
        layout: KVLayout,
        device: torch.device,
        capacity: int | None = None,
        out: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
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
        self._error: KVLoadError | None = None
        self._settled = threading.Event()  # set once the store's bookkeeping (promotion, unpinning) is done
        if out is not None:
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
        """The loader's side: layer i's output buffers to fill, [1, heads, capacity, head_dim] (no wait)."""
        return self._out[i]

    def mark_loaded(self, i: int, copied: torch.cuda.Event | None = None) -> None:
        """The loader's side: layer i's first num_tokens are filled and verified; readers may take them.
        `copied`: on CUDA, the event recorded on the loader's copy stream after layer i's copies; a reader
        makes its own stream wait on it (the GPU waits, not the thread)."""
        self._events[i] = copied
        self._k[i], self._v[i] = self._out[i]
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
        the caller may keep and write past them (they are its own once loaded)."""
        self._ready[i].wait()
        k, v = self._k[i], self._v[i]
        if k is None or v is None:
            assert self._error is not None
            raise self._error
        event = self._events[i]
        if event is not None:
            torch.cuda.current_stream(k.device).wait_event(event)
        return k, v

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
