"""Store configuration and the small result types callers see."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .eviction import POLICIES
from .tier_names import TIERS, Tier, tier_rank

PLACEMENT_HINTS = ("ttft_priority", "throughput")
EVICTION_POLICIES = tuple(POLICIES)  # each within the scheduler's order (schedule.py)
L2_FORMATS = ("safetensors",)  # one safetensors file per chunk (chunk_format.py)


def default_read_workers() -> int:
    """Threads reading a load's disk chunks: one per core this process may run on, at least 2 and at
    most 8. Each thread checksums the layer it read, so threads past the cores only take turns; two let
    one thread's wait for the disk overlap another's checksum; 8 keep enough 1 MiB reads in flight for
    an NVMe drive (measured: docs/benchmarks.md, "Tier throughput")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return min(8, max(2, cores))


@dataclass
class StoreConfig:
    """Capacities are tensor bytes; 0 disables a tier. L0 lives on `device`, L1 in host memory."""

    l0_capacity_bytes: int
    l1_capacity_bytes: int
    l2_capacity_bytes: int
    l2_path: Path
    chunk_tokens: int = 256
    device: str | torch.device = "cpu"
    async_save: bool = True  # False: put() writes L2 before returning
    save_workers: int = 1
    save_queue_chunks: int = 32  # bounded queue; a chunk put() cannot queue is not written (saving.py)
    load_workers: int = 4  # load() threads the store owns; more loads at once wait their turn
    read_workers: int = field(default_factory=default_read_workers)  # a load's disk reads in parallel
    # Where a turn's new KV and what a load read stay in memory: "ttft_priority" keeps them in L0, ready
    # for the session's next turn; "throughput" keeps L0 for running and queued jobs (prefetch), and new
    # or restored KV goes to L1 (and L2).
    placement_hint: str = "ttft_priority"
    # Drop each L2 file from the OS page cache once it is durable, so reading it back is a disk read
    # (benchmarks of the disk tier; or to leave the page cache to other uses).
    drop_page_cache: bool = False
    # After a full disk, saving pauses this long before it tries again (doubling while the disk stays
    # full, up to a minute).
    disk_full_backoff_s: float = 1.0
    l0_eviction: str = "lru"
    l1_eviction: str = "lru"
    l2_format: str = "safetensors"
    # The most of each tier that retention holds keep ahead of everything else (retention.py): the rest
    # stays in the tier's own order for every session, however many holds clients ask for.
    retention_max_share: float = 0.8
    # On CUDA: the pinned host memory grown once at start for L1's buffers and the staging of disk reads
    # and saves (pinned_pool.py); None: as much as L1 holds plus one load's staging; 0: none.
    pinned_pool_bytes: int | None = None

    def __post_init__(self) -> None:
        self.l2_path = Path(self.l2_path)
        for name in ("l0_capacity_bytes", "l1_capacity_bytes", "l2_capacity_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("l0_eviction", "l1_eviction"):
            if getattr(self, name) not in EVICTION_POLICIES:
                raise ValueError(f"{name} must be one of {', '.join(EVICTION_POLICIES)}")
        if self.pinned_pool_bytes is not None and self.pinned_pool_bytes < 0:
            raise ValueError("pinned_pool_bytes must be >= 0 (or None: L1's capacity and one load's)")
        if not 0 < self.retention_max_share <= 1:
            raise ValueError(f"retention_max_share must be in (0, 1], got {self.retention_max_share}")
        if self.l2_format not in L2_FORMATS:
            raise ValueError(f"l2_format must be one of {', '.join(L2_FORMATS)}")
        if self.placement_hint not in PLACEMENT_HINTS:
            raise ValueError(f"placement_hint must be one of {', '.join(PLACEMENT_HINTS)}")
        positive = (
            "chunk_tokens",
            "save_workers",
            "save_queue_chunks",
            "load_workers",
            "read_workers",
            "disk_full_backoff_s",
        )
        if any(getattr(self, name) <= 0 for name in positive):
            raise ValueError(f"{', '.join(positive)} must be positive")


def resolve_device(device: str | torch.device) -> torch.device:
    """The device with its index ("cuda" -> "cuda:<current>"), so that it compares equal to the device
    of the tensors on it (a buffer already on L0's device is then never copied again)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a match: its key, where it starts, how many of its tokens are used, its tier."""

    key: str
    start: int
    n_tokens: int
    tier: Tier


@dataclass(frozen=True)
class PrefixMatch:
    namespace: str
    tokens: int
    chunks: tuple[ChunkRef, ...]

    @property
    def tier(self) -> Tier | None:
        """The slowest tier among the chunks (the one a restore waits on); None when nothing matched."""
        if self.tokens == 0 or not self.chunks:
            return None
        return max((c.tier for c in self.chunks), key=tier_rank)

    def first(self, n: int) -> PrefixMatch:
        """The match cut to its first n chunks (a caller that restores only part of it)."""
        chunks = self.chunks[:n]
        return PrefixMatch(self.namespace, sum(c.n_tokens for c in chunks), chunks)

    def tokens_by_tier(self) -> dict[Tier, int]:
        """Matched tokens per tier, every tier named (0 where none came from it)."""
        counts = dict.fromkeys(TIERS, 0)
        for c in self.chunks:
            counts[c.tier] += c.n_tokens
        return counts
