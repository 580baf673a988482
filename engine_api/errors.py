"""What a turn's first step may raise instead of an event, and the rule both engines admit hits by.

QueueFull    no place for the turn now: upstream when the upstream serves the model, else 503
OverShare    past the client's fair share of the queue while others wait: 429, Retry-After
EngineError  refused (its status, message, code): the client's answer as it says
"""

from __future__ import annotations


class QueueFull(RuntimeError):
    """The engine cannot take the turn now (no running slot, no queue place): the serving layer sends
    it upstream when the upstream serves the model, else answers 503. Raised by both engines."""


class OverShare(RuntimeError):
    """This client holds its fair share of the queue while other clients wait: 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineError(Exception):
    """A turn an engine refuses before its first event (its server refused the request, or cannot be
    reached): the serving layer answers the client with this status, message, code and error type
    (None: the status's usual type)."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, type_: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type_


def counts_as_hit(reusable_tokens: int, prompt_tokens: int) -> bool:
    """At a full queue a turn with at least half its prompt stored still runs here, where it is cheap
    (cost-aware routing): the one rule both engines apply."""
    return reusable_tokens * 2 >= prompt_tokens
