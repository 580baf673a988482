"""The vLLM OpenAI server command for one local model, from settings (no process is started here).

What each setting becomes (settings_check.py refuses the rest):

    local_runner.models          --model <HF folder> --served-model-name <name> (a GGUF is converted once)
    local_runner.dtype           --dtype (auto: float32 on a CPU without native bfloat16, else vLLM's own)
    local_runner.device          cuda:N -> CUDA_VISIBLE_DEVICES=N (auto: whatever the vLLM install runs on)
    local_runner.max_running     --max-num-seqs
    local_runner.max_batch_tokens  --max-num-batched-tokens
    tiering.l0_gpu.capacity_mb   --kv-cache-memory-bytes (vLLM's own KV memory is tier l0)
    position_encoding.max_context_tokens  --max-model-len (at most the model's own context)
    attention_store.*            the connector's kv_connector_extra_config (kvtier/vllm_link/options.py)
    local_runner.vllm_args       appended as given (e.g. --no-enable-prefix-caching, -O0, --enforce-eager)
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..settings import Settings, resolve_path

MB = 1024 * 1024
ATTNSTORE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding kvtier/: vLLM imports it from there
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    socket_path: str | None  # the connector's store socket (None: the store is off)


def connector_options(settings: Settings, socket_path: str, base_dir: Path) -> dict[str, Any]:
    store = settings.attention_store
    tiering = store.tiering
    return {
        "l1_capacity_bytes": int(tiering.l1_host.capacity_mb * MB),
        "l2_capacity_bytes": int(tiering.l2_disk.capacity_mb * MB),
        "l2_path": str(resolve_path(tiering.l2_disk.path, base_dir)),
        "chunk_tokens": settings.local_runner.kv_chunk_tokens,
        "socket_path": socket_path,
        "async_save": store.preload.async_save,
        "prefetch": store.preload.enabled,
        "lookahead": store.preload.lookahead_turns,
        "scheduler_aware": store.scheduler_aware.enabled,
        "layerwise": store.preload.enabled and store.preload.overlap_with_compute,
        "placement_hint": store.scheduler_aware.placement_hint,
        "drop_page_cache": settings.local_runner.l2_drop_page_cache,
        "l1_eviction": tiering.l1_host.eviction,
        "l2_format": tiering.l2_disk.format,
    }


def vllm_dtype(dtype: str, device: str, cpu_flags: frozenset[str]) -> str:
    """`auto` keeps vLLM's choice except on a CPU-only machine without native bfloat16 arithmetic, where
    vLLM's choice (the checkpoint's bfloat16) runs several times slower than float32 (FACTS.md)."""
    if dtype != "auto":
        return dtype
    cuda = device.startswith("cuda") or Path("/dev/nvidia0").exists()
    return "auto" if cuda or (BF16_CPU_FLAGS & cpu_flags) else "float32"


def model_context(folder: Path) -> int | None:
    """The model's own context length from its config.json, when it says."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def vllm_launch(
    settings: Settings,
    name: str,
    folder: Path,
    port: int,
    socket_path: str,
    *,
    base_dir: Path,
    cpu_flags: frozenset[str] = frozenset(),
) -> Launch:
    lr = settings.local_runner
    store = settings.attention_store
    context = store.position_encoding.max_context_tokens
    own = model_context(folder)
    argv = [
        lr.vllm_python or sys.executable,
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(folder), "--served-model-name", name),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", vllm_dtype(lr.dtype, lr.device, cpu_flags)),
        *("--max-num-seqs", str(lr.max_running), "--max-num-batched-tokens", str(lr.max_batch_tokens)),
        *("--kv-cache-memory-bytes", str(int(store.tiering.l0_gpu.capacity_mb * MB))),
        *("--max-model-len", str(min(context, own) if own else context)),
    ]
    if store.enabled:
        transfer = {
            "kv_connector": "AttnStoreConnector",
            "kv_connector_module_path": "kvtier.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",  # a chunk that fails to restore is recomputed
            "kv_connector_extra_config": connector_options(settings, socket_path, base_dir),
        }
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    argv += lr.vllm_args
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ATTNSTORE_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if lr.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = lr.device.split(":", 1)[1]
    return Launch(argv, env, socket_path if store.enabled else None)
