"""The seam below the serving layer: what an engine (the embedded `local_runner`, or vLLM with kvtier's
connector) does for a turn, and nothing above it.

The serving layer renders the prompt, admits the turn, writes the answer in whichever API shape the
client asked for, and records the session; an engine takes "run this turn on these token ids" and
yields its events. The turn and its events are the embedded engine's own types (`local_runner.jobs`),
which the vLLM engine produces too:

    GenerationRequest  in: model, prompt ids, sampling, tenant, session, the session's chunk keys
    FirstToken         the prompt is processed: reused tokens per tier, position shift, when
    TextDelta          text of the answer, in order
    Finished           the end: finish reason, token counts, reused tokens, the chunk keys it saved
    Failed             an error; before FirstToken it is the client's answer (status, code)

A new API or option is then written once, above this seam, for both engines.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

from local_runner.jobs import Event, GenerationRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from local_runner.runner import RunnerStats


class QueueFull(RuntimeError):
    """The engine cannot take the turn now (no running slot, no queue place): the serving layer sends
    it upstream when the upstream serves the model, else answers 503."""


class OverShare(RuntimeError):
    """This client holds its fair share of the queue while other clients wait: 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def counts_as_hit(reusable_tokens: int, prompt_tokens: int) -> bool:
    """At a full queue a turn with at least half its prompt stored still runs here, where it is cheap
    (cost-aware routing): the one rule both engines apply."""
    return reusable_tokens * 2 >= prompt_tokens


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
        displace it) and OverShare past the client's share. Closing the iterator before its end
        cancels the turn."""
        ...

    def load(self) -> int: ...

    def describe(self) -> dict[str, Any]: ...

    def stats(self) -> RunnerStats: ...

    def forget_session(self, tenant: str, session: str) -> int: ...

    async def aclose(self) -> None:
        """On the event loop, before `close`: what the engine holds there (HTTP sessions)."""
        ...

    def close(self) -> None: ...
