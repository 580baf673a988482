"""The engine interface: what an engine (the embedded `local_runner.engine.EmbeddedEngine`, or
`vllm_engine.engine.VllmEngine`: vLLM with attnstore's connector) does for the serving layer, and nothing
above it.

The serving layer renders the prompt, admits the turn, writes the answer in whichever API shape the
client asked for, and records the session; an engine takes "run this turn on these token ids" (a
`turn.GenerationRequest`) and yields its events (`turn.Event`), or raises at its first step what
`errors.py` names. A new API or option is then written once, above this interface, for both engines.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

from .stats import EngineStats
from .turn import Event, GenerationRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Engine(Protocol):
    # The tier a finished turn's KV is in, as the session index records it ("l0" on the embedded
    # engine, "l1" under vLLM, whose paged memory is not kvtier's L0).
    record_tier: str

    def serves(self, model: str) -> bool: ...

    def tokenizer(self, model: str) -> PreTrainedTokenizerBase:
        """The model's tokenizer for the calling thread (tokenizers are not shared across threads)."""
        ...

    def context_limit(self, model: str) -> int:
        """Prompt + answer tokens one turn of this model may hold."""
        ...

    def max_context_tokens(self) -> int:
        """The longest prompt any of its models takes (0: unknown)."""
        ...

    def fingerprint(self, model: str) -> str:
        """What `system_fingerprint` says of this model's build (weights, dtype, engine)."""
        ...

    def run(self, gen: GenerationRequest, *, may_overflow: bool) -> AsyncGenerator[Event, None]:
        """The turn's events, FirstToken (or Failed) first. The first step raises QueueFull when the
        engine cannot take the turn (`may_overflow`: the upstream could serve it instead, so a hit may
        displace it), OverShare past the client's share, and EngineError when it refuses the turn.
        Closing the iterator before its end cancels the turn."""
        ...

    def load(self) -> int:
        """Turns queued or running (the heartbeat announces it; forwarding weighs it)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Per served model, what /healthz shows (device, dtype, batching)."""
        ...

    def stats(self) -> EngineStats:
        """The engine's and its KV stores' counters. Blocking (it may take the stores' locks)."""
        ...

    def forget_session(self, tenant: str, session: str) -> int:
        """Drop this tenant's session from every tier; the number of chunks dropped. Blocking."""
        ...

    def retain(self, tenant: str, session: str, seconds: float) -> None:
        """Keep this tenant's session in the fastest tier it fits for `seconds` (> 0), ahead of idle
        sessions: the store gives it up after every unretained chunk (kvtier/retention.py). The serving
        layer calls it when a turn ends in tool calls or carried a retention hint. Blocking."""
        ...

    async def aclose(self) -> None:
        """On the event loop, before `close`: what the engine holds there (HTTP sessions)."""
        ...

    def close(self) -> None:
        """Stop: the engine's work ends and its stores' pending L2 writes finish (a restart finds every
        chunk). Blocking; called once, off the event loop."""
        ...
