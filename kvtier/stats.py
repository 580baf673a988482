"""Counters the store keeps, and the snapshot it hands out (the proxy serves `to_dict()` as JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .tier_names import TIERS, Tier


def _per_tier() -> dict[str, int]:
    return dict.fromkeys(TIERS, 0)


@dataclass
class Counters:
    """The store's counters. Changed only through the methods below, with the store's lock held;
    read (for a snapshot) under the same lock."""

    hits: dict[str, int] = field(default_factory=_per_tier)  # per lookup, by the match's slowest tier
    chunk_hits: dict[str, int] = field(default_factory=_per_tier)  # per matched chunk, by its tier
    misses: int = 0  # lookups that matched 0 tokens, plus loads that failed
    load_errors: int = 0
    quarantined: int = 0
    bytes_loaded: int = 0  # KV bytes handed to callers by load()
    bytes_saved: int = 0  # KV bytes written to L2 files
    save_errors: int = 0
    saves_skipped: int = 0  # chunks not written to L2 because the save queue was full (kept in memory only)
    reused_tokens: dict[str, int] = field(default_factory=_per_tier)  # matched tokens, by their chunk's tier
    prefetch_issued: int = 0  # chunks a prefetch set out to bring up
    prefetch_completed: int = 0  # of those, placed in a memory tier
    prefetch_used: int = 0  # of those, matched by a job's lookup while still in memory
    prefetch_wasted: int = 0  # of those, evicted from memory before any job used them
    retention_evictions: int = 0  # retention holds broken by pressure (a retained chunk evicted early)

    def lookup(self, tier: Tier | None) -> None:
        """A counted lookup: a hit of its slowest tier, or a miss (None)."""
        if tier is None:
            self.misses += 1
        else:
            self.hits[tier] += 1

    def chunk_matched(self, tier: Tier, n_tokens: int) -> None:
        self.chunk_hits[tier] += 1
        self.reused_tokens[tier] += n_tokens

    def load_failed(self) -> None:
        """A load that cannot be served is a miss, and an error of its own."""
        self.misses += 1
        self.load_errors += 1

    def loaded(self, nbytes: int) -> None:
        self.bytes_loaded += nbytes

    def saved(self, nbytes: int) -> None:
        self.bytes_saved += nbytes

    def save_failed(self) -> None:
        self.save_errors += 1

    def save_skipped(self) -> None:
        self.saves_skipped += 1

    def file_quarantined(self) -> None:
        self.quarantined += 1

    def prefetch_set_out(self, n_chunks: int) -> None:
        self.prefetch_issued += n_chunks

    def prefetch_placed(self) -> None:
        self.prefetch_completed += 1

    def prefetch_was_used(self) -> None:
        self.prefetch_used += 1

    def prefetch_was_wasted(self) -> None:
        self.prefetch_wasted += 1

    def retention_broken(self) -> None:
        self.retention_evictions += 1


@dataclass(frozen=True)
class TierStats:
    used_bytes: int
    capacity_bytes: int
    entries: int


@dataclass(frozen=True)
class StoreStats:
    tiers: dict[str, TierStats]
    hits: dict[str, int]
    chunk_hits: dict[str, int]
    misses: int
    evictions: int
    evictions_by_tier: dict[str, int]
    bytes_loaded: int
    bytes_saved: int
    saves_pending: int
    save_errors: int
    saves_skipped: int
    saving_enabled: bool
    load_errors: int
    quarantined: int
    reused_tokens: dict[str, int]
    prefetch_issued: int
    prefetch_completed: int
    prefetch_used: int
    prefetch_wasted: int
    # Retention (retention.py): sessions held now, their chunks' bytes per tier, holds broken by pressure.
    retained_sessions: int = 0
    retained_bytes: dict[str, int] = field(default_factory=_per_tier)
    retention_evictions: int = 0

    def to_dict(self) -> dict:
        """JSON-able: {"tiers": {"l0": {"used_bytes", "capacity_bytes", "entries"}, ...}, "hits": {...}, ...}."""
        return asdict(self)
