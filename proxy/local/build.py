"""Build the local serving stack from settings: models, one KV store per model, the runner, and the
serving layer above it.

Model loading is slow the first time (GGUF de-quantization), so it happens before the server listens;
tests load the model once and pass it in through `models`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvtier import KVStore, StoreConfig
from local_runner import exact_kernel
from local_runner.compiled import use_cache_dir
from local_runner.loader import LoadedModel, load_model
from local_runner.runner import Runner, RunnerConfig

from ..cluster.session_index import SessionIndex
from ..serving.service import LocalServing, UpstreamFallback
from ..settings import EmbeddedRunnerSettings, Settings, resolve_path, runner_settings
from .engine import EmbeddedEngine

MB = 1024 * 1024


def load_models(settings: Settings, base_dir: Path | None = None) -> dict[str, LoadedModel]:
    lr = runner_settings(settings, EmbeddedRunnerSettings)
    base = base_dir or Path.cwd()
    return {
        name: load_model(
            name,
            source if source.startswith("pkg:") else str(resolve_path(source, base)),
            device=lr.device,
            dtype=lr.dtype,
            cache_dir=resolve_path(lr.cache_dir, base),
            threads=lr.threads,
        )
        for name, source in lr.models.items()
    }


def open_stores(
    settings: Settings, models: Mapping[str, LoadedModel], base_dir: Path | None = None
) -> dict[str, KVStore]:
    """One store per model: keys carry the model's fingerprint, so models may share the L2 folder."""
    store_settings = settings.attention_store
    if not store_settings.enabled:
        return {}
    tiering = store_settings.tiering
    l2 = resolve_path(tiering.l2_disk.path, base_dir or Path.cwd())
    return {
        name: KVStore(
            StoreConfig(
                l0_capacity_bytes=int(tiering.l0_gpu.capacity_mb * MB),
                l1_capacity_bytes=int(tiering.l1_host.capacity_mb * MB),
                l2_capacity_bytes=int(tiering.l2_disk.capacity_mb * MB),
                l2_path=l2,
                chunk_tokens=settings.local_runner.kv_chunk_tokens,
                device=lm.device,
                async_save=store_settings.preload.async_save,
                placement_hint=store_settings.scheduler_aware.placement_hint,
                drop_page_cache=settings.local_runner.l2_drop_page_cache,
                l0_eviction=tiering.l0_gpu.eviction,
                l1_eviction=tiering.l1_host.eviction,
                l2_format=tiering.l2_disk.format,
            ),
            lm.layout,
            lm.fingerprint,
        )
        for name, lm in models.items()
    }


def runner_config(settings: Settings) -> RunnerConfig:
    """The embedded runner's options, every one of them from settings.json."""
    lr = runner_settings(settings, EmbeddedRunnerSettings)
    preload = settings.attention_store.preload
    aware = settings.attention_store.scheduler_aware
    position = settings.attention_store.position_encoding
    return RunnerConfig(
        max_queue=lr.max_queue,
        max_running=lr.max_running,
        max_batch_tokens=lr.max_batch_tokens,
        batch_invariant=None if lr.batch_invariant == "auto" else bool(lr.batch_invariant),
        compile=lr.compile,
        kv_budget_bytes=lr.max_running_kv_mb * MB,
        lookahead=preload.lookahead_turns if (preload.enabled and aware.enabled) else 0,
        scheduler_aware=aware.enabled,
        overlap_with_compute=preload.enabled and preload.overlap_with_compute,
        evict_on_pressure=aware.evict_on_pressure,
        min_free_memory_bytes=lr.min_free_memory_mb * MB,
        device_reserve_bytes=(
            settings.attention_store.tiering.l0_gpu.capacity_mb * MB
            if settings.attention_store.enabled
            else 0
        ),
        max_context_tokens=position.max_context_tokens,
        truncate_on_overflow=position.truncate_on_overflow,
        decouple=position.decouple,
    )


def build_local_backend(
    settings: Settings,
    index: SessionIndex,
    models: Mapping[str, LoadedModel],
    *,
    overflow: UpstreamFallback | None = None,
    base_dir: Path | None = None,
) -> LocalServing:
    """The stores, the runner (its worker starts here) and the serving layer; `close()` stops them all."""
    lr = runner_settings(settings, EmbeddedRunnerSettings)
    cache_dir = resolve_path(lr.cache_dir, base_dir or Path.cwd())
    exact_kernel.use_cache_dir(cache_dir)
    if lr.compile:
        use_cache_dir(cache_dir / "compiled")
    runner = Runner(models, open_stores(settings, models, base_dir), runner_config(settings))
    return LocalServing.from_settings(
        EmbeddedEngine(runner), settings, index, overflow=overflow, base_dir=base_dir or Path.cwd()
    )
