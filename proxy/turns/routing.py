"""Decide where a turn (chat, completion, response) goes: the local backend, the upstream, or nowhere
(a clear 400, or OpenAI's 404 model_not_found for a model neither local nor upstream)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..openai.requests import ApiRequest
from ..settings import Settings
from .backend import LocalBackend


@dataclass(frozen=True, slots=True)
class Route:
    kind: Literal["local", "upstream", "none"]
    # Why the request is not local (None for a local route); shown to the client when kind == "none".
    reason: str | None = None
    # A model this proxy does not serve at all: not local, and no upstream to ask.
    unknown_model: bool = False


def choose_route(settings: Settings, req: ApiRequest, backend: LocalBackend | None) -> Route:
    lr = settings.local_runner
    reason: str | None
    local_model = backend is not None and lr.enabled and req.model in lr.models
    if local_model:
        assert backend is not None
        reason = backend.supports(req)
        if reason is None:
            return Route("local")
    else:
        reason = f"model {req.model!r} is not served locally"
    if settings.llm_endpoint.base_url:
        return Route("upstream", reason)
    return Route(
        "none",
        f"{reason} and no upstream is configured (llm_endpoint.base_url is empty)",
        unknown_model=not local_model,
    )
