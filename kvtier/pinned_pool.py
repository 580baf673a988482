"""Torch's pinned host pool, grown once when a CUDA store starts rather than chunk by chunk as L1 fills.

Why: every L1 buffer and every staging buffer of a disk read or a save is page-locked memory from torch's
caching host allocator. A block it has not cached yet is a cudaHostAlloc, which page-locks the memory
there and then (a cost that grows with the block), paid by whoever asked: a put (a turn's end, its
pages' release) or a load (an L2 hit's TTFT). Freed blocks are cached and handed out again, never given
back to the driver until the cache is emptied. So the store allocates, on a thread of its own at start,
as many chunk-sized blocks as L1 holds plus one load's staging, and frees them at once: from then on an
allocation of a chunk reuses a block (issue 37: host memory "allocated once, reused"). The allocator
rounds each block up to a power of two and caches each size apart, so the pool is grown with blocks of
exactly the chunk's size, which later chunks of that size take, and with one block of each smaller power
of two down to SMALLEST_BLOCK: a sequence's shorter last chunk (a turn's end) then finds one cached too.

Memory the machine lacks is not taken: the pool grows by at most half of the host memory available at
start. `empty_host_cache` gives cached blocks back (memory pressure: shedding L1 frees nothing otherwise).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from .pressure import available_memory_bytes

log = logging.getLogger(__name__)

# One load's disk chunks are staged at once before they move to the device (or into L1): a 8k-token turn
# of 256-token chunks is 32 of them.
STAGING_CHUNKS = 32
# The smallest block grown ahead for a shorter last chunk (a few tokens of an 8B-shape model: 128 KiB
# a token); the smaller ones page-lock little.
SMALLEST_BLOCK = 1 << 20


def empty_host_cache() -> None:
    """Give torch's cached pinned blocks back to the driver (those no copy still uses); a no-op where
    this torch has no such call."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if empty is not None and torch.cuda.is_available():
        empty()


class PinnedPoolWarmer:
    """Grows torch's pinned pool by `blocks` blocks of `block_bytes` on a thread of its own (started at
    once); `close` stops it between two blocks and waits for it."""

    def __init__(
        self,
        block_bytes: int,
        blocks: int,
        available: Callable[[], int | None] = available_memory_bytes,
    ) -> None:
        self.block_bytes = block_bytes
        self.blocks = blocks
        self.grown = 0  # blocks allocated so far (then freed into torch's cache)
        self._available = available
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._grow, name="kvtier-pinned-pool", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the pool has grown (tests, benchmarks); False if the timeout passed first."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _grow(self) -> None:
        started = time.perf_counter()
        available = self._available()
        blocks = self.blocks
        if available is not None:  # never more than half of what the machine has free now, counting
            taken = 1 << (self.block_bytes - 1).bit_length()  # each block as torch rounds it up
            blocks = min(blocks, available // 2 // taken)
        held: list[torch.Tensor] = []  # all held until the end, so each is a block of its own
        sizes = [self.block_bytes] * blocks
        if blocks:  # one block of each smaller power of two (together less than one chunk's)
            size = 1 << ((self.block_bytes - 1).bit_length() - 1)
            while size >= SMALLEST_BLOCK:
                sizes.append(size)
                size //= 2
        try:
            for size in sizes:
                if self._stop.is_set():
                    break
                held.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
        except Exception as exc:  # a pool not grown only makes the first allocations slower
            log.warning("kvtier: growing the pinned host pool stopped: %s", exc)
        self.grown = sum(1 for h in held if h.numel() == self.block_bytes)
        del held  # the blocks go to torch's cache, for the chunks to come
        log.info(
            "kvtier: pinned host pool grown by %d blocks of %.1f MB (%.2f GB) in %.1f s",
            self.grown,
            self.block_bytes / 1e6,
            self.grown * self.block_bytes / 1e9,
            time.perf_counter() - started,
        )
