"""Start the vLLM engine from its config: one vLLM server per model, each model ready to serve.

Start-up says what it does and waits (vLLM takes minutes to start: imports, weights, compilation); the
servers start together and are waited for in turn. Whatever fails stops every server already started,
and an interpreter that exits without closing the engine stops them too (server.py), so no vLLM
outlives the process that started it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from engine_api.model_source import ModelLoadError, converted_folder, cpu_flags, file_digest, resolve_source
from engine_api.tokenizers import ThreadTokenizers

from .engine import ServedModel
from .launch import VllmConfig, max_model_len, vllm_dtype, vllm_launch
from .link.wire import AsyncStoreClient
from .server import VllmServer, check_vllm_python, free_port


def model_folder(name: str, source: str, cache_dir: Path) -> Path:
    """The HF folder vLLM loads: the source itself, or a GGUF's safetensors copy (converted once, the
    same copy the embedded engine makes)."""
    path = resolve_source(source)
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise ModelLoadError(f"model {name!r}: vLLM serves an HF folder or a .gguf file, not {source!r}")
    return converted_folder(name, path, file_digest(path), cache_dir)


def start_servers(config: VllmConfig) -> dict[str, tuple[VllmServer, Path]]:
    """Every model's server started, then waited for; each with the folder it loaded."""
    check_vllm_python(config.python or sys.executable)
    sockets = Path(tempfile.mkdtemp(prefix="attnstore-vllm-"))  # short paths: a socket's is limited
    flags = cpu_flags()
    started: dict[str, tuple[VllmServer, Path]] = {}
    try:
        for name, source in config.models.items():
            folder = model_folder(name, source, config.cache_dir)
            port = free_port()
            launch = vllm_launch(
                config, name, folder, port, str(sockets / f"{len(started)}.sock"), cpu_flags=flags
            )
            log_path = config.log_dir / f"{name}.{config.log_tag.replace('/', '_')}.log"
            started[name] = (VllmServer(name, launch, port, log_path), folder)
        for server, _ in started.values():
            server.wait_ready(config.start_timeout_s)
    except BaseException:
        for server, _ in started.values():
            server.stop()
        raise
    return started


def start_models(config: VllmConfig) -> dict[str, ServedModel]:
    """Start (and wait for) every model's vLLM now: the models a `VllmEngine` serves."""
    dtype = vllm_dtype(config.dtype, config.device, cpu_flags())
    return {
        name: ServedModel(
            name=name,
            server=server,
            tokenizers=ThreadTokenizers(AutoTokenizer.from_pretrained(folder)),
            limit=max_model_len(config, folder),
            dtype=dtype,
            store=AsyncStoreClient(server.launch.socket_path) if server.launch.socket_path else None,
        )
        for name, (server, folder) in start_servers(config).items()
    }
