"""A turn's prompt for an engine as the serving layer renders it: `engine_api.prompt.fit_turn` (the one
rendering path) at the engine's context limit, truncating where its config says so."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine_api.prompt import RenderedPrompt, fit_turn
from local_runner.engine import EmbeddedEngine


def render(
    engine: EmbeddedEngine, model: str, messages: Sequence[dict[str, Any]], reserve: int = 1
) -> RenderedPrompt:
    return fit_turn(
        engine.tokenizer(model),
        messages,
        model=model,
        limit=engine.context_limit(model),
        reserve=reserve,
        truncate=engine.config.truncate_on_overflow,
    )
