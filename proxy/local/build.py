"""Build the local serving stack from settings: models, one KV store per model, the embedded engine, and
the serving layer above it.

Model loading is slow the first time (GGUF de-quantization), so it runs once the server listens, off the
event loop (`turns.local_start`); tests load the model once and pass it in through `models`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

from engine_api.model_source import resolve_source
from kvtier import KVStore, StoreConfig
from local_runner import exact_kernel
from local_runner.compiled import use_cache_dir
from local_runner.engine import EmbeddedEngine
from local_runner.loader import LoadedModel, load_model, pick_device

from ..cluster.session_index import SessionIndex
from ..serving.service import LocalServing, UpstreamFallback
from ..settings import EmbeddedRunnerSettings, Settings, resolve_path, runner_settings, tier_bytes_per_model
from .config import engine_config


def build_cpu_kernels_meanwhile(settings: Settings, base_dir: Path | None = None) -> None:
    """On a CPU, start the exact kernels' build (once per machine, kept under the cache folder) on a
    thread of its own, so that it runs while the models load (a GGUF's first conversion) instead of
    after (docs/benchmarks.md, "What a start costs"); the engine's own call waits for it (`exact_kernel.build` is idempotent
    and thread-safe). On CUDA nothing: those kernels serve CPUs only. A model that cannot be found
    stops the start first (ModelLoadError), before a build that would then run on for nothing."""
    lr = runner_settings(settings, EmbeddedRunnerSettings)
    if pick_device(lr.device).type != "cpu":
        return
    base = base_dir or Path.cwd()
    for source in _sources(settings, base).values():
        resolve_source(source)
    cache_dir = resolve_path(lr.cache_dir, base)
    threading.Thread(
        target=exact_kernel.build, args=(cache_dir,), name="attnstore-kernel-build", daemon=True
    ).start()


def _sources(settings: Settings, base: Path) -> dict[str, str]:
    """Each served model's source: `pkg:NAME`, or its path resolved against `base`."""
    models = runner_settings(settings, EmbeddedRunnerSettings).models
    return {
        name: source if source.startswith("pkg:") else str(resolve_path(source, base))
        for name, source in models.items()
    }


def load_models(settings: Settings, base_dir: Path | None = None) -> dict[str, LoadedModel]:
    lr = runner_settings(settings, EmbeddedRunnerSettings)
    base = base_dir or Path.cwd()
    return {
        name: load_model(
            name,
            source,
            device=lr.device,
            dtype=lr.dtype,
            cache_dir=resolve_path(lr.cache_dir, base),
            threads=lr.threads,
        )
        for name, source in _sources(settings, base).items()
    }


def open_stores(
    settings: Settings, models: Mapping[str, LoadedModel], base_dir: Path | None = None
) -> dict[str, KVStore]:
    """One store per model: keys carry the model's fingerprint, so models may share the L2 folder; each
    tier's capacity is shared evenly by the models' stores."""
    store_settings = settings.attention_store
    if not store_settings.enabled:
        return {}
    tiering = store_settings.tiering
    l2 = resolve_path(tiering.l2_disk.path, base_dir or Path.cwd())
    return {
        name: KVStore(
            StoreConfig(
                device=lm.device,
                l0_capacity_bytes=tier_bytes_per_model(settings, tiering.l0_gpu.capacity_mb),
                l0_eviction=tiering.l0_gpu.eviction,
                l1_capacity_bytes=tier_bytes_per_model(settings, tiering.l1_host.capacity_mb),
                l1_eviction=tiering.l1_host.eviction,
                l2_capacity_bytes=tier_bytes_per_model(settings, tiering.l2_disk.capacity_mb),
                l2_path=l2,
                l2_format=tiering.l2_disk.format,
                drop_page_cache=settings.local_runner.l2_drop_page_cache,
                chunk_tokens=settings.local_runner.kv_chunk_tokens,
                async_save=store_settings.preload.async_save,
                placement_hint=store_settings.scheduler_aware.placement_hint,
                retention_max_share=store_settings.retention.max_share,
            ),
            lm.layout,
            lm.fingerprint,
        )
        for name, lm in models.items()
    }


def build_local_backend(
    settings: Settings,
    index: SessionIndex,
    models: Mapping[str, LoadedModel],
    *,
    overflow: UpstreamFallback | None = None,
    base_dir: Path | None = None,
) -> LocalServing:
    """The stores, the engine (its worker starts here) and the serving layer; `close()` stops them all."""
    lr = runner_settings(settings, EmbeddedRunnerSettings)
    cache_dir = resolve_path(lr.cache_dir, base_dir or Path.cwd())
    exact_kernel.use_cache_dir(cache_dir)
    if lr.compile:
        use_cache_dir(cache_dir / "compiled")
    stores = open_stores(settings, models, base_dir)
    engine = EmbeddedEngine(models, stores, config=engine_config(settings)).start()
    return LocalServing.from_settings(
        engine, settings, index, overflow=overflow, base_dir=base_dir or Path.cwd()
    )
