"""Every running job's KV in one pool of pages per model (nano-vllm's block manager, with the store's
chunk size as the page size).

Why pages: a job's context is then bounded by the model and the pool, never by a per-job split of the
memory, and a restore or a save moves whole chunks: a page holds exactly one kvtier chunk, laid out as
the chunk's buffer is ([layers, 2, kv_heads, page_tokens, head_dim] across the pool's layer axis), so
restoring a chunk into a page is one copy per layer (or one per chunk), and a save reads a page as it
lies.

Layout: one buffer [layers, pages, 2, kv_heads, page_tokens, head_dim]. Page p of layer i is
buf[i, p]: its K then its V, each head's tokens contiguous. The attention kernels read a layer's K as
buf[i, :, 0] ([pages, kv_heads, page_tokens, head_dim], page stride 2 * kv_heads * page_tokens *
head_dim) through each job's page table.

Ownership: the pool owns the free list (under its lock: the worker allocates, the save hand-off frees);
each job's `JobKV` (job_kv.py) owns the pages it holds and gives them back when the job is done.

Reads after the free (CUDA): a save may still copy freed pages to the host on the store's own stream
(kvtier's put), so a page comes back with the event after those reads. A page whose read is done is
taken before one still read; when one still read must be taken (the oldest read first), its next
owner's stream waits for that event (a wait on the device, none on the host): a page is never written
while it is read, and a step waits for a save only when the pool has no other page.

Memory: on the CPU the buffer is an anonymous mmap: its pages take no memory until a job writes them,
the lowest free pages are handed out first so the touched part stays compact, and `give_back` returns
the memory of free pages to the OS under memory pressure. On CUDA the buffer is allocated on the device
at first use, sized from the device memory (`cuda_pages`).
"""

from __future__ import annotations

import contextlib
import heapq
import mmap
import threading

import torch

from kvtier import KVLayout

KV = tuple[torch.Tensor, torch.Tensor]

# The kernels read keys in blocks of 16 (exact_attention.cpp's tiles) or of the largest power of two up
# to their config's block (16 to 64: triton_attention.AttentionConfig) that divides the page: a page
# holds whole blocks, so a block never straddles two pages.
PAGE_MULTIPLE = 16
# A page of a model without a store (the store's chunk size otherwise): kvtier's default chunk.
DEFAULT_PAGE_TOKENS = 256


class PoolExhausted(Exception):
    """No free page is left for a job's next tokens (the scheduler preempts or waits)."""


class PagePool:
    def __init__(self, layout: KVLayout, device: torch.device, pages: int, page_tokens: int) -> None:
        if pages <= 0:
            raise ValueError(f"a KV pool needs at least one page, got {pages}")
        if page_tokens <= 0 or page_tokens % PAGE_MULTIPLE:
            raise ValueError(f"a KV page holds a multiple of {PAGE_MULTIPLE} tokens, got {page_tokens}")
        self.layout = layout
        self.device = device
        self.pages = pages
        self.page_tokens = page_tokens
        self._lock = threading.Lock()
        # Free pages nothing reads, as a heap: the lowest page first keeps the touched memory compact.
        self._free = list(range(pages))
        # Free pages a save may still read, one batch per `free` call, with the event that ends its read.
        self._reading: list[tuple[torch.cuda.Event, list[int]]] = []
        self._free_count = pages
        self._is_free = [True] * pages
        self._buf: torch.Tensor | None = None
        self._mmap: mmap.mmap | None = None

    # ---- pages --------------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """`n` free pages (the lowest first), or PoolExhausted with none taken. Allocates the buffer on
        first use. On CUDA, the caller's current stream waits for the reads still running on pages it
        takes (`free`'s `read_until`), so everything it then queues writes them after those reads."""
        if n <= 0:
            return []
        with self._lock:
            if self._free_count < n:
                raise PoolExhausted(f"{n} KV pages wanted, {self._free_count} free of {self.pages}")
            taken, reads = self._take(n)
            for p in taken:
                self._is_free[p] = False
            self._free_count -= n
        for event in reads:  # only reads still running (_take let the finished ones go)
            torch.cuda.current_stream(self.device).wait_event(event)
        self._ensure()
        return taken

    def _take(self, n: int) -> tuple[list[int], list[torch.cuda.Event]]:
        """With the lock held: `n` pages, the lowest that nothing reads first, then those a save still
        reads, oldest read first, with the events their taker must wait for. Why this order: the wait
        for a read holds up the taker's stream, which every running job's step shares, and a long
        turn's copies to the host run at the link's speed, far longer than a step.

        Cost: one event query per batch still read (one batch per saved job, not per page), then
        O(n log free): a pool whose every free page is still read is never scanned page by page."""
        still_read: list[tuple[torch.cuda.Event, list[int]]] = []
        for event, batch in self._reading:
            if event.query():  # the read is over: the pages join those nothing reads
                for p in batch:
                    heapq.heappush(self._free, p)
            else:
                still_read.append((event, batch))
        self._reading = still_read
        taken = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
        waits: list[torch.cuda.Event] = []
        while len(taken) < n:
            event, batch = self._reading[0]
            want = n - len(taken)
            taken += batch[:want]
            waits.append(event)
            if want < len(batch):
                self._reading[0] = (event, batch[want:])
            else:
                self._reading.pop(0)
        return taken, waits

    def free(self, pages: list[int], *, read_until: torch.cuda.Event | None = None) -> None:
        """Give pages back. `read_until`: the event after which nothing reads them any more (a save's
        copies to the host on another stream); their next owner waits for it (see allocate)."""
        with self._lock:
            if len(set(pages)) != len(pages) or any(
                not 0 <= p < self.pages or self._is_free[p] for p in pages
            ):
                raise ValueError(f"pages {pages} are out of range or freed twice")
            for p in pages:
                self._is_free[p] = True
            self._free_count += len(pages)
            if read_until is None:
                for p in pages:
                    heapq.heappush(self._free, p)
            elif pages:
                self._reading.append((read_until, sorted(pages)))

    @property
    def free_pages(self) -> int:
        with self._lock:
            return self._free_count

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    @property
    def capacity(self) -> int:
        """The most tokens one job could hold: every page."""
        return self.pages * self.page_tokens

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_tokens * self.layout.bytes_per_token

    # ---- views --------------------------------------------------------------------------------------

    @property
    def buffer(self) -> torch.Tensor:
        """The whole pool, [layers, pages, 2, kv_heads, page_tokens, head_dim]."""
        return self._ensure()

    def take_memory(self) -> None:
        """Allocate the buffer now rather than at the first job's pages: on CUDA, before another pool or
        measurement reads what the device has free."""
        self._ensure()

    def layer(self, i: int) -> KV:
        """Layer i's K and V of every page, [pages, kv_heads, page_tokens, head_dim] each (strided views)."""
        buf = self._ensure()
        return buf[i, :, 0], buf[i, :, 1]

    def page(self, p: int) -> torch.Tensor:
        """Page p across every layer, [layers, 2, kv_heads, page_tokens, head_dim] (a chunk's layout)."""
        return self._ensure()[:, p]

    # ---- memory -------------------------------------------------------------------------------------

    def give_back(self) -> int:
        """Return the memory of every free page to the OS (CPU only; it reads as zeros again). Bytes
        given back at most (memory never written costs nothing and is counted too)."""
        if self._mmap is None:
            return 0
        with self._lock:
            free = sorted(self._free + [p for _event, batch in self._reading for p in batch])
        lay = self.layout
        per_page = 2 * lay.num_kv_heads * self.page_tokens * lay.head_dim * lay.itemsize
        os_page = mmap.PAGESIZE
        given = 0
        for i in range(lay.num_layers):
            for p in free:
                start = (i * self.pages + p) * per_page
                lo, hi = -(-start // os_page) * os_page, (start + per_page) // os_page * os_page
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
                shape = (lay.num_layers, self.pages, 2, lay.num_kv_heads, self.page_tokens, lay.head_dim)
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


def cuda_pages(
    layout: KVLayout, device: torch.device, page_tokens: int, wanted: int, reserve_bytes: int, share: float
) -> int:
    """On CUDA: how many pages the pool gets: at most `wanted`, within `share` of the device memory
    free now once `reserve_bytes` (the store's L0, the step's activations) are set aside."""
    free, _total = torch.cuda.mem_get_info(device)
    page_bytes = page_tokens * layout.bytes_per_token
    fit = int(max(0, free - reserve_bytes) * share) // page_bytes
    return max(1, min(wanted, fit))
