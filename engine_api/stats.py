"""An engine's counters as the proxy serves them (/v1/attention_store/stats, /metrics)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.stats import StoreStats  # torch-free: the store's snapshot type only


@dataclass(frozen=True)
class EngineStats:
    queued: int
    running: int
    cancelled: int  # turns stopped because their client went away
    stores: dict[str, StoreStats]  # per served model with a KV store
    shifted_turns: int = 0  # turns that reused KV moved to new positions after a truncation
    shifted_tokens: int = 0  # the tokens so moved
    admitted: int = 0  # turns taken from the queue so far
    queue_wait_seconds: float = 0.0  # their time in the queue, summed (mean = this / admitted)
    waiting_clients: int = 0  # clients with turns in the queue (admission alternates between them)
    forked_tokens: int = 0  # n > 1: prompt tokens copied from the first answer's KV, not computed
