"""settings.json -> the embedded engine's config (`local_runner.config.EngineConfig`), torch-free.

The schema (proxy/settings.py) holds every default; the config is derived from it and never restates
one. Tests and benchmarks start from the same defaults (`engine_config()`) and replace what they vary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from local_runner.config import EngineConfig

from ..settings import MB, EmbeddedRunnerSettings, Settings, runner_settings


def engine_config(settings: Settings | None = None, **fields: Any) -> EngineConfig:
    """The embedded engine's options, every one of them from settings.json (None: the schema's defaults),
    then `fields` replaced (a test's or a benchmark's own values)."""
    settings = settings or Settings()
    lr = runner_settings(settings, EmbeddedRunnerSettings)
    preload = settings.attention_store.preload
    aware = settings.attention_store.scheduler_aware
    position = settings.attention_store.position_encoding
    config = EngineConfig(
        max_queue=lr.max_queue,
        max_running=lr.max_running,
        max_batch_tokens=lr.max_batch_tokens,
        batch_invariant=None if lr.batch_invariant == "auto" else bool(lr.batch_invariant),
        compile=lr.compile,
        kv_budget_bytes=lr.max_running_kv_mb * MB,
        # Fetching follows preload alone (docs/tiering.md, as the vLLM engine's); scheduler_aware is
        # the eviction's, which then protects the fetched chunks too.
        lookahead=preload.lookahead_turns if preload.enabled else 0,
        scheduler_aware=aware.enabled,
        overlap_with_compute=preload.enabled and preload.overlap_with_compute,
        evict_on_pressure=aware.evict_on_pressure,
        min_free_memory_bytes=lr.min_free_memory_mb * MB,
        device_reserve_bytes=(
            int(settings.attention_store.tiering.l0_gpu.capacity_mb * MB)
            if settings.attention_store.enabled
            else 0
        ),
        max_context_tokens=position.max_context_tokens,
        truncate_on_overflow=position.truncate_on_overflow,
        decouple=position.decouple,
    )
    return dataclasses.replace(config, **fields) if fields else config
