"""The embedded engine's one typed config: every option of a `Runner` (nano-vllm's `Config`), checked once
when it is made. proxy/local/build.py fills it from settings.json; tests and benchmarks make their own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerConfig:
    max_queue: int = 16  # jobs waiting to run; past it a submit is refused (429 above)
    max_running: int = 4  # jobs in one batched step
    lookahead: int = 1  # queued turns whose stored KV is prefetched (0: none)
    max_batch_tokens: int = 512  # tokens one step feeds (chunked prefill); below 1 counts as 1
    kv_budget_bytes: int = 0  # KV of the running jobs; 0: bounded by max_running only
    max_context_tokens: int | None = None  # None: each model's own context
    truncate_on_overflow: bool = False  # drop the oldest turns of a prompt that does not fit (else refuse)
    decouple: bool = False  # a truncated turn moves its kept KV to the new positions (exact RoPE only)
    batch: bool = True  # packed steps (every job of a model in one forward) where the model allows
    # a job's logits do not depend on what else runs (docs/engine.md, "Batch invariance"); None: where
    # that was measured to cost little (model_step.invariant_by_default)
    batch_invariant: bool | None = None
    compile: bool = False  # the packed step compiled (torch.compile), eager until it is ready
    scheduler_aware: bool = True  # the stores see the queue (prefetch, keep what is about to be used)
    overlap_with_compute: bool = True  # a job may compute while its layers still load
    evict_on_pressure: bool = True  # at low free memory, evict stored KV before refusing a turn
    min_free_memory_bytes: int = 0  # 0: no memory-pressure check at admission
    device_reserve_bytes: int = 0  # on CUDA, device memory the KV pool leaves to others (the store's L0)

    def __post_init__(self) -> None:
        at_least = {
            "max_queue": 1,
            "max_running": 1,
            "lookahead": 0,
            "kv_budget_bytes": 0,
            "min_free_memory_bytes": 0,
            "device_reserve_bytes": 0,
        }
        if self.max_context_tokens is not None:
            at_least["max_context_tokens"] = 1
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"RunnerConfig.{name} must be at least {low}, not {getattr(self, name)}")
