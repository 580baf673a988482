"""Admission of local turns, all in one place: how many local requests one client may have in flight
(`ClientLimiter`, 429), submitting a job to the runner where a hit may wait for room (`submit`), and a full
queue (`queue_full`: the upstream takes the turn when it serves the same model, else 503).

This is today's admission, kept as it is; the runner's fair per-client queues (issue 18) replace it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web

from local_runner.jobs import GenerationRequest, Job
from local_runner.runner import Runner
from local_runner.worker import QueueFull

from ..chat_request import ChatRequest
from ..errors import APIError
from ..tenant import ANONYMOUS, tenant_of
from ..turn import Turn

# Where a turn goes when the local queue is full (`upstream.upstream_fallback`): its answer, or an APIError.
UpstreamFallback = Callable[[web.Request, ChatRequest, Turn], Awaitable[web.StreamResponse]]


def client_id(request: web.Request) -> str:
    """The tenant (a hash of the key), or the remote address for a caller without a key."""
    tenant = tenant_of(request.headers)
    return tenant if tenant != ANONYMOUS else f"addr:{request.remote or '?'}"


class ClientLimiter:
    """At most `limit` requests in flight per client (0: no limit). Used on the event loop only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_flight: dict[str, int] = {}

    def acquire(self, client: str) -> Callable[[], None]:
        """Count one more request of `client` and return its release, or raise a 429."""
        n = self._in_flight.get(client, 0)
        if self.limit and n >= self.limit:
            raise APIError(
                429,
                f"Too many concurrent requests from this client (at most {self.limit} served locally "
                "at once); retry when one has finished.",
                code="too_many_concurrent_requests",
            )
        self._in_flight[client] = n + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self._in_flight.get(client, 1) - 1
            if left > 0:
                self._in_flight[client] = left
            else:
                self._in_flight.pop(client, None)

        return release

    def in_flight(self, client: str) -> int:
        return self._in_flight.get(client, 0)


class LocalAdmission:
    def __init__(
        self,
        runner: Runner,
        *,
        max_concurrent_per_client: int = 0,
        hit_queue_wait_s: float = 0.0,
        overflow: UpstreamFallback | None = None,
    ) -> None:
        self.runner = runner
        self.clients = ClientLimiter(max_concurrent_per_client)
        self.hit_queue_wait_s = hit_queue_wait_s
        # Where a turn goes when the local queue is full and the upstream serves the same model.
        self.overflow = overflow

    @contextlib.contextmanager
    def per_client(self, request: web.Request) -> Iterator[None]:
        """Held while one local request of this client is in flight (429 past the client's limit)."""
        release = self.clients.acquire(client_id(request))
        try:
            yield
        finally:
            release()

    async def submit(self, gen: GenerationRequest) -> Job:
        """Queue the job. When the local queue is full, a turn that would be a miss gives up at once
        (QueueFull: it goes upstream when the upstream serves this model, else 503), while a hit waits
        up to `hit_queue_wait_s` for room: its KV is here, where it is cheap to serve. A hit reuses at
        least half its prompt (a shared system prompt alone does not make a turn cheap)."""
        try:
            return self.runner.submit(gen)
        except QueueFull:
            if self.hit_queue_wait_s <= 0:
                raise
            reusable = await asyncio.to_thread(self.runner.reusable_tokens, gen)
            if reusable * 2 < len(gen.prompt_ids):
                raise
        deadline = time.monotonic() + self.hit_queue_wait_s
        while True:
            await asyncio.sleep(0.05)
            try:
                return self.runner.submit(gen)
            except QueueFull:
                if time.monotonic() >= deadline:
                    raise

    async def queue_full(
        self, request: web.Request, chat: ChatRequest, turn: Turn, exc: QueueFull
    ) -> web.StreamResponse:
        """The answer to a turn that found the local queue full: the upstream's, or a 503."""
        if self.overflow is not None:
            return await self.overflow(request, chat, turn)
        raise APIError(503, f"{exc}; retry later", code="queue_full")
