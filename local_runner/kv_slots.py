"""Every running job's KV in one pool per model: a slot per job, one tensor per layer for all slots.

Why a pool: a decode step attends for every decoding job in ONE call per layer (batched attention over
[slots, kv_heads, tokens, head_dim], each slot masked past its own length), which needs all jobs' K and V
in one tensor. A job gets a slot when it is admitted and gives it back when it ends (after its restore,
if any, has settled: the store writes restored KV straight into the slot, see kvtier `load(out=...)`).

Layout: one buffer [layers, 2, slots, kv_heads, capacity, head_dim]; K of layer i is buf[i, 0]. A slot's
region of one layer is contiguous (kv_heads x capacity x head_dim), which is what the store's restore and
the batched attention read and write.

Memory: `capacity` is the most tokens a job may hold (the model's context as the runner limits it). On
the CPU the buffer is an anonymous mmap: its pages are zero and take no memory until a job writes them,
so the pool costs what the jobs actually hold (a high-water mark per slot), and `give_back` returns the
pages of free slots to the OS under memory pressure. On CUDA it is allocated (zeroed) on the device at
first use, so its capacity is sized to the device memory there (see `cuda_capacity`).
"""

from __future__ import annotations

import contextlib
import mmap
import threading

import torch

from kvtier import KVLayout

from .exact_attention import KEY_BLOCK, padded_keys

KV = tuple[torch.Tensor, torch.Tensor]


class SlotPool:
    def __init__(self, layout: KVLayout, device: torch.device, slots: int, capacity: int) -> None:
        if slots <= 0 or capacity <= 0:
            raise ValueError(f"a KV pool needs slots and capacity > 0, got {slots} x {capacity}")
        self.layout = layout
        self.device = device
        self.slots = slots
        # whole key blocks: exact attention reads a row's keys in blocks of KEY_BLOCK (exact_attention.py)
        self.capacity = padded_keys(capacity)
        self._lock = threading.Lock()
        self._free = list(range(slots))  # kept sorted: the lowest slot first keeps the busy range short
        self._buf: torch.Tensor | None = None
        self._mmap: mmap.mmap | None = None

    # ---- slots --------------------------------------------------------------------------------------

    def acquire(self) -> int | None:
        """The lowest free slot, or None when every slot is taken. Allocates the pool on first use."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop(0)
        self._ensure()
        return slot

    def release(self, slot: int) -> None:
        with self._lock:
            if slot in self._free or not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} released twice or out of range")
            self._free.append(slot)
            self._free.sort()

    @property
    def free(self) -> int:
        return len(self._free)

    # ---- views --------------------------------------------------------------------------------------

    def layer(self, i: int) -> KV:
        """Layer i's K and V of every slot, [slots, kv_heads, capacity, head_dim] each."""
        buf = self._ensure()
        return buf[i, 0], buf[i, 1]

    def slot_layers(self, slot: int) -> list[KV]:
        """Every layer's K and V of one slot, [1, kv_heads, capacity, head_dim] each (views, no copy)."""
        buf = self._ensure()
        return [
            (buf[i, 0, slot : slot + 1], buf[i, 1, slot : slot + 1]) for i in range(self.layout.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return self.slots * self.capacity * self.layout.bytes_per_token

    # ---- memory -------------------------------------------------------------------------------------

    def give_back(self) -> int:
        """Return the memory pages of every free slot to the OS (CPU only; they read as zeros again).
        Bytes given back at most (pages never written cost nothing and are counted too)."""
        if self._mmap is None:
            return 0
        with self._lock:
            free = list(self._free)
        lay = self.layout
        per_slot = lay.num_kv_heads * self.capacity * lay.head_dim * lay.dtype.itemsize
        page = mmap.PAGESIZE
        given = 0
        for i in range(lay.num_layers):
            for kv in (0, 1):
                for slot in free:
                    start = ((i * 2 + kv) * self.slots + slot) * per_slot
                    lo, hi = -(-start // page) * page, (start + per_slot) // page * page
                    if hi > lo:
                        self._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                        given += hi - lo
        return given

    def _ensure(self) -> torch.Tensor:
        if self._buf is not None:
            return self._buf
        with self._lock:
            if self._buf is None:
                lay = self.layout
                shape = (lay.num_layers, 2, self.slots, lay.num_kv_heads, self.capacity, lay.head_dim)
                if self.device.type == "cpu":
                    self._mmap = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                    self._buf = torch.frombuffer(self._mmap, dtype=lay.dtype).view(shape)
                else:
                    self._buf = torch.zeros(shape, dtype=lay.dtype, device=self.device)
        return self._buf

    def close(self) -> None:
        """Drop the buffer (views held elsewhere keep the memory until they go)."""
        with self._lock:
            self._buf = None
            if self._mmap is not None:
                with contextlib.suppress(BufferError):  # a view still alive: the GC frees it later
                    self._mmap.close()
                self._mmap = None


def cuda_capacity(layout: KVLayout, device: torch.device, slots: int, wanted: int, share: float = 0.5) -> int:
    """On CUDA: the per-slot capacity (tokens) that keeps the pool within `share` of the device memory
    free now, at most `wanted`. The runner then limits a job's prompt + answer to it."""
    free, _total = torch.cuda.mem_get_info(device)
    fit = int(free * share) // max(1, slots * layout.bytes_per_token)
    return max(KEY_BLOCK, min(wanted, fit // KEY_BLOCK * KEY_BLOCK))
