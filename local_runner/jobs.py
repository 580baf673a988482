"""A submitted turn inside the embedded engine (`Job`) and how its events reach the event loop.

The engine's worker thread produces events; the request handler consumes them on the event loop. The hand-over
is `loop.call_soon_threadsafe(queue.put_nowait, event)`, so the worker never blocks on a slow client.
Events the worker thread emits during a step go through its `Outbox`: one wake-up of the event loop per
step for all jobs, instead of one per job and token (each wake-up is the event loop taking a core from
the step's OpenMP threads on a small machine).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable

from engine_api.turn import Event, Failed, Finished, GenerationRequest


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

    Owners: `request` is the caller's (read-only here); `max_tokens`, `kv_bytes`, `submitted_at`, `loop`
    and `outbox` are set once at construction; `_events` is written on `loop` only (`_deliver`); `_cancelled` is a
    thread-safe flag set by `cancel` (the client) or `_unreachable` (its loop closed); `done` is written
    by `emit` alone, when the last event goes out (from whichever side ends the job: the worker, its save
    hand-off, or the scheduler refusing it in the queue), and only ever from False to True."""

    def __init__(
        self,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        *,
        max_tokens: int | None = None,
        bytes_per_token: int = 0,
        on_cancel: Callable[[Job], None] | None = None,
        outbox: Outbox | None = None,
    ):
        self.request = request
        # The answer's cap: what the request asks, or less so that prompt + answer fit the context.
        self.max_tokens = request.sampling.max_tokens if max_tokens is None else max_tokens
        # The KV its prompt and capped answer may take (its model's bytes per token): what admission
        # reserves for it.
        self.kv_bytes = (len(request.prompt_ids) + self.max_tokens) * bytes_per_token
        self.submitted_at = time.monotonic()  # queue wait = admission - this
        self.loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._on_cancel = on_cancel
        self.done = False
        self.outbox = outbox  # the engine's worker's: its events during a step are held there

    def cancel(self) -> None:
        """Called from the event loop when the client goes away: a waiting job leaves the queue at once
        (`on_cancel`: the scheduler's), a running one is dropped at the worker's next step."""
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
