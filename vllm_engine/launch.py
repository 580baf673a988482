"""The vLLM OpenAI server command for one model, from the engine's config (no process is started here).

What each field of `VllmConfig` becomes (proxy/local_vllm/config.py fills it from settings.json):

    models              --model <HF folder> --served-model-name <name> (a GGUF is converted once, start.py)
    dtype               --dtype (auto: as the embedded engine's, bfloat16 on CUDA and on a CPU with
                        native bfloat16, else float32)
    device              cuda:N -> CUDA_VISIBLE_DEVICES=N (auto: whatever the vLLM install runs on)
    max_running         --max-num-seqs
    max_batch_tokens    --max-num-batched-tokens
    kv_cache_bytes      --kv-cache-memory-bytes (vLLM's own KV memory is tier l0)
    max_context_tokens  --max-model-len (at most the model's own context)
    connector           the connector's kv_connector_extra_config (link/options.py), with the model's socket
    args                appended as given (e.g. --no-enable-prefix-caching, -O0, --enforce-eager)

vLLM loads the connector by module path (`vllm_engine.connector`), so its Python gets the folder holding
this package (and kvtier beside it) on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_api.model_source import ModelLoadError, auto_dtype

ATTNSTORE_ROOT = Path(__file__).resolve().parents[1]  # the folder holding vllm_engine/ and kvtier/
CONNECTOR_MODULE = "vllm_engine.connector"
MB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class VllmConfig:
    """The vLLM engine's configuration: one vLLM OpenAI server per model, all started alike. Every field is
    a setting: proxy/local_vllm/config.py derives it from settings.json, whose schema holds the defaults."""

    models: Mapping[str, str]  # served name -> its weights: an HF folder, a .gguf file, or pkg:NAME
    python: str  # the interpreter that runs vLLM ("": this one)
    args: tuple[str, ...]
    dtype: str
    device: str
    max_running: int
    max_batch_tokens: int
    kv_cache_bytes: int
    max_context_tokens: int
    # The connector's options but its socket (link/options.py); None: vLLM runs without the store.
    connector: Mapping[str, Any] | None
    cache_dir: Path  # a GGUF's safetensors copy
    log_dir: Path  # each server's log: <model>.<log_tag>.log
    log_tag: str
    start_timeout_s: float


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    socket_path: str | None  # the connector's store socket (None: the store is off)


def vllm_dtype(dtype: str, device: str, cpu_flags: frozenset[str]) -> str:
    """The dtype vLLM is told, never `auto`, so that the health report and the store's fingerprint name what
    runs. `auto` means what it means for the embedded engine (engine_api.model_source.auto_dtype)."""
    if dtype != "auto":
        return dtype
    return auto_dtype(device.startswith("cuda") or Path("/dev/nvidia0").exists(), cpu_flags)


def _model_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _positive(config: dict[str, Any], name: str) -> int | None:
    value = config.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_context(folder: Path) -> int | None:
    """The model's own context length from its config.json, when it says."""
    return _positive(_model_config(folder), "max_position_embeddings")


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_bytes_per_token(folder: Path, dtype: str) -> int | None:
    """The KV one token of the model holds in vLLM's memory (keys and values of every layer), from its
    config.json; None when the config does not say (vLLM itself then judges)."""
    config = _model_config(folder)
    windowed = config.get("sliding_window") and config.get("use_sliding_window") is not False  # Qwen2's off
    if windowed or config.get("kv_lora_rank") or config.get("layer_types"):
        return None  # latent (MLA), windowed or hybrid attention: less than every layer's full KV
    layers, heads = _positive(config, "num_hidden_layers"), _positive(config, "num_attention_heads")
    hidden, width = _positive(config, "hidden_size"), DTYPE_BYTES.get(dtype)
    if layers is None or heads is None or width is None:
        return None
    kv_heads = _positive(config, "num_key_value_heads") or heads
    head_dim = _positive(config, "head_dim") or (hidden // heads if hidden else None)
    return 2 * layers * kv_heads * head_dim * width if head_dim else None


def check_kv_fits(config: VllmConfig, name: str, folder: Path, dtype: str) -> None:
    """Refuse, before vLLM spends minutes starting, a KV memory that cannot hold one turn of the model's
    whole context: vLLM would refuse it at the end of its start, naming its own flags instead of the
    settings. The check is the bare product; vLLM's block rounding it leaves to vLLM."""
    if any(arg.startswith("--kv-cache-dtype") for arg in config.args):
        return  # a KV dtype of its own (fp8): vLLM's to judge
    per_token = kv_bytes_per_token(folder, dtype)
    if per_token is None:
        return
    context = max_model_len(config, folder)
    needed = per_token * context
    if config.kv_cache_bytes >= needed:
        return
    shared = f", its share of {len(config.models)} local models" if len(config.models) > 1 else ""
    raise ModelLoadError(
        f"model {name!r}: one turn of its {context}-token context needs {needed / MB:.0f} MB of KV "
        f"in vLLM's memory, but attention_store.tiering.l0_gpu.capacity_mb gives it "
        f"{config.kv_cache_bytes / MB:.0f} MB{shared}: raise capacity_mb, or lower "
        "attention_store.position_encoding.max_context_tokens"
    )


def max_model_len(config: VllmConfig, folder: Path) -> int:
    """vLLM's --max-model-len: prompt + answer tokens a turn of this model may hold, the config's and at
    most the model's own."""
    own = model_context(folder)
    return min(config.max_context_tokens, own) if own else config.max_context_tokens


def vllm_launch(
    config: VllmConfig,
    name: str,
    folder: Path,
    port: int,
    socket_path: str,
    *,
    cpu_flags: frozenset[str] = frozenset(),
) -> Launch:
    dtype = vllm_dtype(config.dtype, config.device, cpu_flags)
    check_kv_fits(config, name, folder, dtype)
    argv = [
        config.python or sys.executable,
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(folder), "--served-model-name", name),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", dtype),
        *("--max-num-seqs", str(config.max_running)),
        *("--max-num-batched-tokens", str(config.max_batch_tokens)),
        *("--kv-cache-memory-bytes", str(config.kv_cache_bytes)),
        *("--max-model-len", str(max_model_len(config, folder))),
    ]
    if config.connector is not None:
        transfer = {
            "kv_connector": "AttnStoreConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",  # a chunk that fails to restore is recomputed
            "kv_connector_extra_config": {**config.connector, "socket_path": socket_path},
        }
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    argv += config.args
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ATTNSTORE_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if config.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = config.device.split(":", 1)[1]
    return Launch(argv, env, socket_path if config.connector is not None else None)
