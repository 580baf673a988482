"""Local serving on the vLLM engine from settings: the engine's config (config.py), its servers started
and waited for (`vllm_engine.start`: one vLLM per local model), then the serving layer over a
`VllmEngine`; all of it once the proxy listens, off its event loop (`turns.local_start`)."""

from __future__ import annotations

from pathlib import Path

from vllm_engine.engine import VllmEngine
from vllm_engine.start import start_models

from ..cluster.session_index import SessionIndex
from ..serving.service import LocalServing, UpstreamFallback
from ..settings import Settings
from .config import vllm_config


def build_vllm_backend(
    settings: Settings,
    index: SessionIndex,
    *,
    overflow: UpstreamFallback | None = None,
    base_dir: Path | None = None,
) -> LocalServing:
    """Start (and wait for) every model's vLLM, then the serving layer over them. Blocking: called off
    the event loop, once the proxy listens (`turns.local_start`)."""
    base = base_dir or Path.cwd()
    models = start_models(vllm_config(settings, base))
    lr = settings.local_runner
    engine = VllmEngine(
        models,
        max_running=lr.max_running,
        max_queue=lr.max_queue,
        timeout_s=settings.proxy.upstream_timeout_s,
    )
    return LocalServing.from_settings(engine, settings, index, overflow=overflow, base_dir=base)
