"""The state the store's parts share (index, placement, counters) and the one lock that guards it.

Invariants (all under `lock`): every entry in a budget is in the index; an entry leaves the index when
no tier (nor a save in flight) holds its bytes; no budget is ever above capacity; entries with pins > 0
are never evicted. Tensor copies and disk I/O (reads, writes, unlinks, quarantine) happen outside the
lock, so a reader of stats or a lookup never waits behind a copy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from .chunk_files import quarantine
from .config import StoreConfig
from .index import Entry, PrefixIndex
from .layout import KVLayout
from .placement import Copy, Placement
from .stats import Counters
from .tiers import MEMORY_TIERS, Tier


class StoreState:
    def __init__(self, config: StoreConfig, layout: KVLayout, model_fingerprint: str) -> None:
        self.config = config
        self.layout = layout
        self.model_fingerprint = model_fingerprint
        self.device = torch.device(config.device)
        self.pin_host = self.device.type == "cuda"  # pinned host buffers only help copies to CUDA
        self.root = config.l2_path
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.index = PrefixIndex()
        capacities: dict[Tier, int] = {
            "l0": config.l0_capacity_bytes,
            "l1": config.l1_capacity_bytes,
            "l2": config.l2_capacity_bytes,
        }
        self.placement = Placement(self.index, self.root, capacities, self.device, self.pin_host)
        self.counters = Counters()
        self.placement.on_evict = self._on_evict
        # The memory tiers a turn's new KV (put) and a load's chunks (promotion) may go to.
        self.keep_tiers: tuple[Tier, ...] = (
            MEMORY_TIERS if config.placement_hint == "ttft_priority" else ("l1",)
        )

    def _on_evict(self, entry: Entry) -> None:
        """With the lock held: an entry left memory; a prefetch that brought it up was in vain."""
        if entry.prefetched:
            entry.prefetched = False
            self.counters.prefetch_wasted += 1

    def nbytes(self, n_tokens: int) -> int:
        return n_tokens * self.layout.bytes_per_token

    def pin(self, entries: Iterable[Entry]) -> list[Entry]:
        """The one way to pin: a pinned entry is never evicted nor superseded until unpin."""
        with self.lock:
            pinned = list(entries)
            for e in pinned:
                e.pins += 1
            return pinned

    def unpin(self, pinned: Sequence[Entry]) -> None:
        with self.lock:
            for e in pinned:
                e.pins -= 1

    def move(self, copies: list[Copy]) -> None:
        """Run placement's copies with the lock released (call it without holding the lock), then swap
        the results in under it."""
        if not copies:
            return
        for c in copies:
            c.run()
        with self.lock:
            self.placement.commit(copies)

    def quarantine(self, path: Path, reason: str) -> None:
        quarantine(self.root, path, reason)
        with self.lock:
            self.counters.quarantined += 1

    @staticmethod
    def unlink(paths: Sequence[Path]) -> None:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
