"""Admission of local turns: the runner's fair queue, seen from HTTP.

The runner decides (local_runner/admission.py: one queue per client, round-robin, bounded by running
slots + queue places); this module names the client and turns its refusals into answers:

- `OverShare` (this client holds its share of the queue while other clients wait): 429 with Retry-After;
  a waiting job displaced by another client's request ends with the same 429.
- `QueueFull` (no slot, no place): the upstream takes the turn when it serves the same model, else 503.
- Cost-aware routing: when the upstream serves the model, a turn is looked up first; a hit (at least half
  its prompt stored) that finds the queue full takes the place of a waiting miss, which goes upstream
  instead (its handler sees `queue_full` before any token), so hits stay where they are cheap.

No request is refused while a running slot or a queue place is free for it, whoever holds the others.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

from aiohttp import web

from local_runner.admission import OverShare, QueueFull
from local_runner.jobs import Failed, GenerationRequest, Job
from local_runner.runner import Runner

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


def too_many(message: str, retry_after_s: float | None) -> APIError:
    """429 past a client's fair share of the local queue, with when to retry."""
    seconds = max(1, math.ceil(retry_after_s or 1))
    return APIError(429, message, code="too_many_requests", headers={"Retry-After": str(seconds)})


def refused(failed: Failed) -> APIError:
    """A job that ended before its first token: the error the client gets."""
    if failed.status == 429:
        return too_many(failed.message, failed.retry_after_s)
    return APIError(failed.status, failed.message, code=failed.code, type_="server_error")


class LocalAdmission:
    def __init__(
        self,
        runner: Runner,
        *,
        overflow: UpstreamFallback | None = None,
        overflow_model: Callable[[str], bool] = lambda model: False,
    ) -> None:
        self.runner = runner
        # Where a turn goes when the local queue is full, and whether the upstream serves a model.
        self.overflow = overflow
        self.overflow_model = overflow_model

    async def submit(self, request: web.Request, gen: GenerationRequest) -> Job:
        """Queue the job in its client's queue (QueueFull when nothing can take it; 429 past its share)."""
        gen.client = client_id(request)
        hit = False
        if self.overflow is not None and self.overflow_model(gen.model):
            reusable = await asyncio.to_thread(self.runner.reusable_tokens, gen)
            hit = reusable * 2 >= len(gen.prompt_ids)
            gen.may_overflow = not hit
        try:
            return self.runner.submit(gen, hit=hit)
        except OverShare as exc:
            raise too_many(str(exc), exc.retry_after_s) from None

    async def queue_full(
        self, request: web.Request, chat: ChatRequest, turn: Turn, exc: QueueFull
    ) -> web.StreamResponse:
        """The answer to a turn that found the local queue full: the upstream's, or a 503."""
        if self.overflow is not None:
            return await self.overflow(request, chat, turn)
        raise APIError(503, f"{exc}; retry later", code="queue_full")
