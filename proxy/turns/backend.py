"""The one seam between the proxy and local serving: `LocalBackend`.

The app holds one under `app_keys.LOCAL_BACKEND` (None: everything goes upstream), built when the app starts
and closed when it stops (`app.local_serving`, a cleanup_ctx). The turn handlers (chat, completions,
responses) ask it whether it `supports` a request, then let it `handle` a local turn, reporting its
outcome through the `Turn`. The
other endpoints ask it for its load, stats and description, and to forget a session.

`proxy.serving.LocalServing` is the real one (the serving layer, above the embedded engine or vLLM); tests
put stand-ins here.
A stand-in may subclass this protocol to inherit the answers of a backend that holds nothing (no load, no
stats, nothing to close). Nothing here imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from ..openai.requests import ApiRequest
from .turn import Turn

if TYPE_CHECKING:  # torch loads only when the local runner is enabled
    from engine_api.stats import EngineStats


class LocalBackend(Protocol):
    def supports(self, req: ApiRequest) -> str | None:
        """None when this request can be served locally, else the reason it cannot (goes upstream)."""
        ...

    async def handle(self, request: web.Request, req: ApiRequest, turn: Turn) -> web.StreamResponse:
        """Serve the request locally: report the first token to `turn` (`turn.local_first_token`), send
        `turn.headers()` with the answer, `turn.finish(...)` when the answer is complete. Raise
        `APIError` for an error answer (the middleware tags and finishes it)."""
        ...

    def load(self) -> int:
        """Jobs queued or running (the heartbeat announces it; forwarding weighs it)."""
        return 0

    def max_context_tokens(self) -> int:
        """The longest prompt any local model takes, in tokens (0: unknown, no body limit from it)."""
        return 0

    def describe(self) -> dict[str, Any]:
        """Per local model, what /healthz shows (device, dtype, batching)."""
        return {}

    def stats(self) -> EngineStats | None:
        """The runner's and its KV stores' counters. Blocking (it takes the stores' locks)."""
        return None

    def forget_session(self, tenant: str, session: str) -> int:
        """Drop this tenant's session from every tier; the number of chunks dropped. Blocking."""
        return 0

    async def aclose(self) -> None:
        """On the event loop, before `close`: what serving holds there (HTTP sessions)."""
        return None

    def close(self) -> None:
        """Stop serving: the runner's worker, the stores' pending L2 writes (finished, so a restart finds
        every chunk), any thread pools. Blocking; called once, off the event loop, when the app stops."""
        return None
