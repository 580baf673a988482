"""A generation job and the events it streams back to the event loop.

The worker thread produces events; the request handler consumes them on the event loop. The hand-over
is `loop.call_soon_threadsafe(queue.put_nowait, event)`, so the worker never blocks on a slow client.
Events the worker thread emits during a step go through its `Outbox`: one wake-up of the event loop per
step for all jobs, instead of one per job and token (each wake-up is the event loop taking a core from
the step's OpenMP threads on a small machine).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from .params import SamplingParams, TokenLogprob


@dataclass
class GenerationRequest:
    """What a caller asks for. Owned by its caller, and read-only once submitted: the serving layer
    derives variants with `dataclasses.replace` (a compiled grammar, an n > 1 fork), and the engine
    keeps what it decides about a job on the `Job` (its `max_tokens` cap), never here."""

    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    namespace: str = "anonymous"  # the tenant: KV is never shared across namespaces
    session: str | None = None
    hint_keys: Sequence[str] = ()  # KV chunk keys another replica may have saved on the shared disk
    previous_keys: Sequence[str] = ()  # a truncated turn: the session's previous sequence, as chunk keys
    reuse: bool = True
    client: str = ""  # who is asking (a tenant, or an address without a key): admission is fair per client
    # A miss that the upstream could serve instead (it serves the same model): while it waits, a hit
    # that finds the queue full may take its place, and it goes upstream (cost-aware routing).
    may_overflow: bool = False
    # sampling.grammar compiled for this model's tokenizer (the engine's `Grammars.compile`), or None.
    compiled_grammar: object | None = None
    # n > 1: another answer to `fork_of`'s prompt, submitted once that job has its first token; its
    # prompt's KV is copied from that job's slot (the prompt is computed once for the n answers).
    fork_of: GenerationRequest | None = None


@dataclass
class FirstToken:
    """The prompt is processed and the first token chosen: the moment TTFT measures."""

    reused_tokens: int
    tier: str | None  # the slowest tier the reused KV came from ("l0"/"l1"/"l2"), None on a miss
    at: float  # time.monotonic()
    tiers: dict[str, int] = field(default_factory=dict)  # reused tokens per tier
    position_shift: int = 0  # positions the reused KV was moved by after a truncation
    skipped_tokens: int = 0  # stored tokens recomputed, not restored: loading them was measured slower


@dataclass
class TextDelta:
    text: str
    # The tokens this text comes from, when the request asked for logprobs (a delta may carry tokens
    # whose text is still held back, and the last delta may carry tokens without text).
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    chunk_keys: list[str] = field(default_factory=list)  # the conversation's KV chunks, for the session index


@dataclass
class Failed:
    message: str
    status: int = 500  # what the proxy answers when nothing was sent yet
    code: str | None = None  # OpenAI error code, when there is one
    retry_after_s: float | None = None  # a 429: when the client may try again


Event = FirstToken | TextDelta | Finished | Failed


class EngineError(Exception):
    """A turn an engine refuses before its first event (its server refused the request, or cannot be
    reached): the serving layer answers the client with this status, message, code and error type
    (None: the status's usual type)."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, type_: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type_


class Outbox:
    """Events the worker thread emits during a step, delivered to their loops in one call per loop at
    `flush` (the worker flushes after every step). Only the owning thread may add to it; it writes no
    field of a job, it calls the job's own `_deliver` and `_unreachable`."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None  # the only thread whose emits are held here
        self._held: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}

    def hold(self, job: Job, event: Event) -> None:
        self._held.setdefault(job.loop, []).append((job, event))

    def flush(self) -> None:
        held, self._held = self._held, {}
        for loop, items in held.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for job, _ in items:
                    job._unreachable()


def _deliver(items: list[tuple[Job, Event]]) -> None:
    for job, event in items:
        job._deliver(event)


class Job:
    """One submitted request as its client and the engine share it: the event stream between them and
    the cancel flag. The engine's view of a running job (slot, fed tokens, status) is its `JobState`.

    Owners: `request` is the caller's (read-only here); `max_tokens`, `submitted_at`, `loop` and `outbox`
    are set once at construction; `_events` is written on `loop` only (`_deliver`); `_cancelled` is a
    thread-safe flag set by `cancel` (the client) or `_unreachable` (its loop closed); `done` is written
    by `emit` alone, when the last event goes out (from whichever side ends the job: the worker, its save
    hand-off, or the scheduler refusing it in the queue), and only ever from False to True."""

    def __init__(
        self,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        *,
        max_tokens: int | None = None,
        on_cancel: Callable[[Job], None] | None = None,
        outbox: Outbox | None = None,
    ):
        self.request = request
        # The answer's cap: what the request asks, or less so that prompt + answer fit the context.
        self.max_tokens = request.sampling.max_tokens if max_tokens is None else max_tokens
        self.submitted_at = time.monotonic()  # queue wait = admission - this
        self.loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._on_cancel = on_cancel
        self.done = False
        self.outbox = outbox  # the engine's worker's: its events during a step are held there

    def cancel(self) -> None:
        """Called from the event loop when the client goes away: a waiting job leaves the queue at once
        (the runner's `on_cancel`), a running one is dropped at the worker's next step."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel(self)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Event) -> None:
        """Worker side: hand an event to the event loop (never blocks)."""
        if isinstance(event, Finished | Failed):
            self.done = True
        outbox = self.outbox
        if outbox is not None and outbox.thread is threading.current_thread():
            outbox.hold(self, event)
            return
        try:
            self.loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._unreachable()

    def _deliver(self, event: Event) -> None:
        """On `loop`: the event is the client's to read."""
        self._events.put_nowait(event)

    def _unreachable(self) -> None:
        """Its loop is closed: nobody is listening any more, so the worker drops it as cancelled."""
        self._cancelled.set()

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, Finished | Failed):
                return
