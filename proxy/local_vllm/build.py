"""Start the vLLM engine from settings: one vLLM server per local model, then the backend serving them.

Start-up says what it does and waits (vLLM takes minutes to start: imports, weights, compilation);
the servers start together and are waited for in turn. Whatever fails stops every server already
started, and an interpreter that exits without closing the backend stops them too (engine.py), so no
vLLM outlives the proxy that started it.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer

from kvtier.vllm_link.wire import AsyncStoreClient
from local_runner.loader import (
    _READY_MARK,
    ModelLoadError,
    ThreadTokenizers,
    _convert_gguf,
    cpu_flags,
    file_digest,
    resolve_source,
)

from ..backend import LocalBackend
from ..serving.service import LocalServing, UpstreamFallback
from ..session_index import SessionIndex
from ..settings import Settings, replica_id, resolve_path
from .engine import VllmServer, check_vllm_python, free_port
from .launch import model_context, vllm_dtype, vllm_launch
from .turns import ServedModel, VllmEngine

log = logging.getLogger("attnstore")


def model_folder(name: str, source: str, cache_dir: Path) -> Path:
    """The HF folder vLLM loads: the source itself, or a GGUF's safetensors copy (converted once, the
    same copy the embedded runner makes)."""
    path = resolve_source(source)
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise ModelLoadError(f"model {name!r}: vLLM serves an HF folder or a .gguf file, not {source!r}")
    folder = cache_dir / f"{name}-{file_digest(path)[:16]}"
    if not (folder / _READY_MARK).exists():
        _convert_gguf(path, folder)
    return folder


def start_servers(settings: Settings, base_dir: Path) -> dict[str, tuple[VllmServer, Path]]:
    lr = settings.local_runner
    python = lr.vllm_python or sys.executable
    check_vllm_python(python)
    cache_dir = resolve_path(lr.cache_dir, base_dir)
    logs = cache_dir.parent / "vllm"
    sockets = Path(tempfile.mkdtemp(prefix="attnstore-vllm-"))  # short paths: a socket's is limited
    flags = cpu_flags()
    started: dict[str, tuple[VllmServer, Path]] = {}
    try:
        for name, source in lr.models.items():
            folder = model_folder(
                name, source if source.startswith("pkg:") else str(resolve_path(source, base_dir)), cache_dir
            )
            port = free_port()
            launch = vllm_launch(
                settings,
                name,
                folder,
                port,
                str(sockets / f"{len(started)}.sock"),
                base_dir=base_dir,
                cpu_flags=flags,
            )
            log_path = logs / f"{name}.{replica_id(settings).replace('/', '_')}.log"
            started[name] = (VllmServer(name, launch, port, log_path), folder)
        for server, _ in started.values():
            server.wait_ready(lr.vllm_start_timeout_s)
    except BaseException:
        for server, _ in started.values():
            server.stop()
        raise
    return started


def start_vllm_backend(
    settings: Settings,
    index: SessionIndex,
    *,
    overflow: UpstreamFallback | None = None,
    base_dir: Path | None = None,
) -> Callable[[], LocalBackend]:
    """Start (and wait for) every model's vLLM now; return the builder the app calls when it starts."""
    base = base_dir or Path.cwd()
    lr = settings.local_runner
    servers = start_servers(settings, base)
    models: dict[str, ServedModel] = {}
    for name, (server, folder) in servers.items():
        context = settings.attention_store.position_encoding.max_context_tokens
        own = model_context(folder)
        models[name] = ServedModel(
            name=name,
            server=server,
            tokenizers=ThreadTokenizers(AutoTokenizer.from_pretrained(folder)),
            limit=min(context, own) if own else context,
            dtype=vllm_dtype(lr.dtype, lr.device, cpu_flags()),
            store=AsyncStoreClient(server.launch.socket_path) if server.launch.socket_path else None,
        )

    def build() -> LocalBackend:
        engine = VllmEngine(
            models,
            max_running=lr.max_running,
            max_queue=lr.max_queue,
            timeout_s=settings.proxy.upstream_timeout_s,
        )
        return LocalServing.from_settings(engine, settings, index, overflow=overflow, base_dir=base)

    return build
