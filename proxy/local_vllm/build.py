"""Local serving on the vLLM engine from settings: the engine's config (config.py), its servers started
(`vllm_engine.start`: one vLLM per local model, started and waited for once the proxy listens, off its loop), then the serving
layer over a `VllmEngine` when the app starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vllm_engine.engine import VllmEngine
from vllm_engine.start import start_models

from ..cluster.session_index import SessionIndex
from ..serving.service import LocalServing, UpstreamFallback
from ..settings import Settings
from ..turns.backend import LocalBackend
from .config import vllm_config


def start_vllm_backend(
    settings: Settings,
    index: SessionIndex,
    *,
    overflow: UpstreamFallback | None = None,
    base_dir: Path | None = None,
) -> Callable[[], LocalBackend]:
    """Start (and wait for) every model's vLLM now; return the builder the app calls when it starts."""
    base = base_dir or Path.cwd()
    models = start_models(vllm_config(settings, base))
    lr = settings.local_runner

    def build() -> LocalBackend:
        engine = VllmEngine(
            models,
            max_running=lr.max_running,
            max_queue=lr.max_queue,
            timeout_s=settings.proxy.upstream_timeout_s,
        )
        return LocalServing.from_settings(engine, settings, index, overflow=overflow, base_dir=base)

    return build
