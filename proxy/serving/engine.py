"""The seam below the serving layer: what an engine (the embedded `local_runner`, or `vllm_engine`: vLLM
with attnstore's connector) does for a turn, and nothing above it.

The serving layer renders the prompt, admits the turn, writes the answer in whichever API shape the
client asked for, and records the session; an engine takes "run this turn on these token ids" and
yields its events. The turn and its events are the embedded engine's own types (`local_runner.jobs`),
which the vLLM engine produces too:

    GenerationRequest  in: model, prompt ids, sampling, tenant, session, the session's chunk keys
    FirstToken         the prompt is processed: reused tokens per tier, position shift, when
    TextDelta          text of the answer, in order
    Finished           the end: finish reason, token counts, reused tokens, the chunk keys it saved
    Failed             an error; before FirstToken it is the client's answer (status, code)

and what its first step may raise instead of an event (`local_runner.admission`, `local_runner.jobs`:
below the proxy, which neither engine imports):

    QueueFull          no place for the turn now: upstream when the upstream serves the model, else 503
    OverShare          past the client's fair share of the queue while others wait: 429, Retry-After
    EngineError        refused (its status, message, code): the client's answer as it says

A new API or option is then written once, above this seam, for both engines.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

from local_runner.admission import OverShare, QueueFull, counts_as_hit
from local_runner.jobs import EngineError, Event, GenerationRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from local_runner.runner import RunnerStats

__all__ = ["Engine", "EngineError", "OverShare", "QueueFull", "counts_as_hit"]


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

    def load(self) -> int: ...

    def describe(self) -> dict[str, Any]: ...

    def stats(self) -> RunnerStats: ...

    def forget_session(self, tenant: str, session: str) -> int: ...

    async def aclose(self) -> None:
        """On the event loop, before `close`: what the engine holds there (HTTP sessions)."""
        ...

    def close(self) -> None: ...
