"""The embedded engine's one typed config (nano-vllm's `Config`), checked once when it is made.

Every field but `batch` is a setting: proxy/local/config.py derives the config from settings.json, whose
schema (proxy/settings.py) holds each default once; tests and benchmarks start from those defaults too
(`engine_config(**fields)`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_queue: int  # jobs waiting to run; past it a submit is refused (429 above)
    max_running: int  # jobs in one batched step
    lookahead: int  # queued turns whose stored KV is prefetched (0: none)
    max_batch_tokens: int  # tokens one step feeds (chunked prefill)
    kv_budget_bytes: int  # KV of the running jobs; 0: bounded by max_running only
    max_context_tokens: int | None  # None: each model's own context
    truncate_on_overflow: bool  # drop the oldest turns of a prompt that does not fit (else refuse)
    decouple: bool  # a truncated turn moves its kept KV to the new positions (exact RoPE only)
    # a job's logits do not depend on what else runs (docs/engine.md, "Batch invariance"); None: where
    # that costs little (a CPU; on CUDA as measured on the device: kernel_choice.py)
    batch_invariant: bool | None
    compile: bool  # the packed step compiled (torch.compile), eager until it is ready
    scheduler_aware: bool  # the stores see the queue (prefetch, keep what is about to be used)
    overlap_with_compute: bool  # a job may compute while its layers still load
    evict_on_pressure: bool  # at low free memory, evict stored KV before refusing a turn
    min_free_memory_bytes: int  # 0: no memory-pressure check at admission
    device_reserve_bytes: int  # on CUDA, device memory the KV pool leaves to others (the store's L0)
    # Not a setting: packed steps (every job of a model in one forward) where the model allows; False runs
    # one forward per job (a benchmark's same-run baseline).
    batch: bool = True

    def __post_init__(self) -> None:
        at_least = {
            "max_queue": 1,
            "max_running": 1,
            "lookahead": 0,
            "max_batch_tokens": 1,
            "kv_budget_bytes": 0,
            "min_free_memory_bytes": 0,
            "device_reserve_bytes": 0,
        }
        if self.max_context_tokens is not None:
            at_least["max_context_tokens"] = 1
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"EngineConfig.{name} must be at least {low}, not {getattr(self, name)}")

    @property
    def max_step_rows(self) -> int:
        """The rows a step's products are measured up to for batch invariance: the batch's token budget
        plus a decoding token for every running job."""
        return self.max_batch_tokens + self.max_running
