"""settings.json -> the vLLM engine's config (`vllm_engine.launch.VllmConfig`), torch-free.

What each setting becomes (proxy/settings_vllm.py refuses what the engine would ignore; the schema itself
refuses a local_runner key the vLLM engine does not have):

    local_runner.models          the models, one vLLM server each (relative paths from the settings' folder)
    local_runner.vllm_python     the interpreter that runs vLLM ("": this one)
    local_runner.vllm_args       appended to vLLM's command line as given
    local_runner.dtype, device   --dtype, CUDA_VISIBLE_DEVICES
    local_runner.max_running     --max-num-seqs (and the turns in flight, with max_queue: VllmEngine)
    local_runner.max_batch_tokens  --max-num-batched-tokens
    local_runner.cache_dir       a GGUF's converted copy; the servers' logs beside it (../vllm)
    local_runner.vllm_start_timeout_s  how long start-up waits for each server
    tiering.l0_gpu.capacity_mb   --kv-cache-memory-bytes (vLLM's own KV memory is tier l0)
    position_encoding.max_context_tokens  --max-model-len (at most the model's own context)
    attention_store.*            the connector's kv_connector_extra_config (vllm_engine/link/options.py)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_engine.launch import VllmConfig

from ..settings import (
    Settings,
    VllmRunnerSettings,
    replica_id,
    resolve_path,
    runner_settings,
    tier_bytes_per_model,
)


def connector_options(settings: Settings, base_dir: Path) -> dict[str, Any]:
    """The connector's options (its socket is each server's own: the launch adds it)."""
    store = settings.attention_store
    tiering = store.tiering
    return {
        # Each model's server has its own store: a tier's capacity is shared evenly by them.
        "l1_capacity_bytes": tier_bytes_per_model(settings, tiering.l1_host.capacity_mb),
        "l2_capacity_bytes": tier_bytes_per_model(settings, tiering.l2_disk.capacity_mb),
        "l2_path": str(resolve_path(tiering.l2_disk.path, base_dir)),
        "chunk_tokens": settings.local_runner.kv_chunk_tokens,
        "async_save": store.preload.async_save,
        "prefetch": store.preload.enabled,
        "lookahead": store.preload.lookahead_turns,
        "scheduler_aware": store.scheduler_aware.enabled,
        "layerwise": store.preload.enabled and store.preload.overlap_with_compute,
        "placement_hint": store.scheduler_aware.placement_hint,
        "drop_page_cache": settings.local_runner.l2_drop_page_cache,
        "l1_eviction": tiering.l1_host.eviction,
        "l2_format": tiering.l2_disk.format,
        "retention_max_share": store.retention.max_share,
    }


def vllm_config(settings: Settings, base_dir: Path) -> VllmConfig:
    lr = runner_settings(settings, VllmRunnerSettings)
    store = settings.attention_store
    cache_dir = resolve_path(lr.cache_dir, base_dir)
    return VllmConfig(
        # What runs: by which Python with which arguments, the models, on which device in which dtype.
        python=lr.vllm_python,
        args=tuple(lr.vllm_args),
        models={
            name: source if source.startswith("pkg:") else str(resolve_path(source, base_dir))
            for name, source in lr.models.items()
        },
        device=lr.device,
        dtype=lr.dtype,
        # Its bounds: the batch and the context.
        max_running=lr.max_running,
        max_batch_tokens=lr.max_batch_tokens,
        max_context_tokens=store.position_encoding.max_context_tokens,
        # The KV: the store under vLLM (the connector's options; None: off), and vLLM's own memory (l0).
        connector=connector_options(settings, base_dir) if store.enabled else None,
        kv_cache_bytes=tier_bytes_per_model(settings, store.tiering.l0_gpu.capacity_mb),
        # Its files and its start.
        cache_dir=cache_dir,
        log_dir=cache_dir.parent / "vllm",
        log_tag=replica_id(settings),
        start_timeout_s=lr.vllm_start_timeout_s,
    )
