"""The one seam between the proxy and local serving: `LocalBackend`, held by the app's `LocalStart`
(`turns.local_start`: `local_backend(app)`).

The app holds one (None: everything goes upstream), built once the app listens and closed when it stops. The turn handlers (chat, completions, responses) ask it whether it
`supports` a request, then let it `handle` a local turn, reporting its outcome through the `Turn`. What
the other endpoints ask (load, stats, description, forgetting a session) is the engine's: they ask its
`engine` directly (`local_engine`).

`proxy.serving.LocalServing` is the real one (the serving layer, above the embedded engine or vLLM); tests
put stand-ins here. A stand-in may subclass this protocol to inherit the answers of a backend that holds
nothing (no engine, nothing to close). Nothing here imports torch.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from engine_api.engine import Engine

from ..openai.requests import ApiRequest
from .turn import Turn


class LocalBackend(Protocol):
    @property
    def engine(self) -> Engine | None:
        """The engine that runs the turns (None: a stand-in that holds none)."""
        return None

    def supports(self, req: ApiRequest) -> str | None:
        """None when this request can be served locally, else the reason it cannot (goes upstream)."""
        ...

    async def handle(self, request: web.Request, req: ApiRequest, turn: Turn) -> web.StreamResponse:
        """Serve the request locally: report the first token to `turn` (`turn.local_first_token`), send
        `turn.headers()` with the answer, `turn.finish(...)` when the answer is complete. Raise
        `APIError` for an error answer (the middleware tags and finishes it)."""
        ...

    async def count_prompt_tokens(self, req: ApiRequest) -> int:
        """The prompt tokens a local turn of `req` would have, without running it (count_tokens)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """On the event loop, before `close`: what serving holds there (HTTP sessions)."""
        return None

    def close(self) -> None:
        """Stop serving: the engine (its work, the stores' pending L2 writes, finished so a restart finds
        every chunk), any thread pools. Blocking; called once, off the event loop, when the app stops."""
        return None
