"""Serve a chat turn on the local runner: render, reuse stored KV, stream OpenAI chunks, record the session.

The headers go out with the first token (they carry its TTFT and hit level), so a streamed response is
prepared only once the runner reports the prompt processed. A client that goes away cancels its job.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeGuard

from aiohttp import web

from kvtier import TIERS, Tier
from local_runner.jobs import Failed, Finished, FirstToken, GenerationRequest, Job, TextDelta
from local_runner.params import SamplingParams
from local_runner.prompt import PromptError
from local_runner.runner import RenderedPrompt, Runner
from local_runner.worker import QueueFull

from .. import openai_format as fmt
from ..access_log import log_turn
from ..backend import RequestContext
from ..chat_request import ChatRequest
from ..errors import APIError, error_body, error_response
from ..headers import CacheLevel, cache_label, store_headers
from ..limits import ClientLimiter, client_id, max_chars_per_token, precheck_prompt
from ..metrics import Metrics
from ..session_index import SessionIndex, SessionRecord
from .options import sampling_params, unsupported_reason

log = logging.getLogger("attnstore")

OnFinish = Callable[[Finished], Awaitable[None]]
UpstreamFallback = Callable[[web.Request, ChatRequest, RequestContext], Awaitable[web.StreamResponse]]


def _is_tier(name: str) -> TypeGuard[Tier]:
    return name in TIERS


def cache_level(tier: str | None, reused: int) -> CacheLevel:
    """The slowest tier the turn reused KV from, or "miss" when it reused nothing."""
    if not (tier and reused):
        return "miss"
    if not _is_tier(tier):
        raise ValueError(f"the runner reported an unknown tier {tier!r}")
    return tier


class LocalChatBackend:
    def __init__(
        self,
        runner: Runner,
        index: SessionIndex,
        metrics: Metrics,
        *,
        replica: str,
        reuse: bool = True,
        default_max_tokens: int = 512,
        overflow: UpstreamFallback | None = None,
        max_concurrent_per_client: int = 0,
        tokenize_threads: int = 2,
        truncate_on_overflow: bool = False,
        hit_queue_wait_s: float = 0.0,
    ):
        self.runner = runner
        self.index = index
        self.metrics = metrics
        self.replica = replica
        self.reuse = reuse
        self.default_max_tokens = default_max_tokens
        # Where a turn goes when the local queue is full and the upstream serves the same model.
        self.overflow = overflow
        # Cheap limits before expensive work (proxy/limits.py): per-client concurrency, the prompt
        # bound, and a small pool of its own for tokenizing (the default executor stays free).
        self.clients = ClientLimiter(max_concurrent_per_client)
        self.truncate_on_overflow = truncate_on_overflow
        self.hit_queue_wait_s = hit_queue_wait_s
        self.tokenize_pool = ThreadPoolExecutor(tokenize_threads, thread_name_prefix="attnstore-tokenize")
        self._chars_per_token: dict[str, int] = {}

    def supports(self, chat: ChatRequest) -> str | None:
        if not self.runner.serves(chat.model):
            return f"model {chat.model!r} is not served locally"
        return unsupported_reason(chat.body)

    async def handle(
        self, request: web.Request, chat: ChatRequest, ctx: RequestContext
    ) -> web.StreamResponse:
        sampling = sampling_params(chat.body, self.default_max_tokens)
        release = self.clients.acquire(client_id(request))
        try:
            return await self._handle(request, chat, ctx, sampling)
        finally:
            release()

    async def _tokenize(self, chat: ChatRequest, reserve: int) -> RenderedPrompt:
        """Prompt ids, on the tokenize pool; a prompt that certainly cannot fit is refused first."""
        loop = asyncio.get_running_loop()
        per_token = self._chars_per_token.get(chat.model)
        if per_token is None:
            tokenizer = self.runner.models[chat.model].tokenizers.get
            per_token = await loop.run_in_executor(
                self.tokenize_pool, lambda: max_chars_per_token(tokenizer())
            )
            self._chars_per_token[chat.model] = per_token
        messages = precheck_prompt(
            chat.model,
            chat.messages,
            limit=self.runner.context_limit(chat.model),
            max_chars_per_token=per_token,
            truncate=self.truncate_on_overflow,
        )
        try:
            return await loop.run_in_executor(
                self.tokenize_pool, self.runner.render_turn, chat.model, messages, reserve
            )
        except PromptError as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None

    async def _handle(
        self, request: web.Request, chat: ChatRequest, ctx: RequestContext, sampling: SamplingParams
    ) -> web.StreamResponse:
        rendered = await self._tokenize(chat, sampling.max_tokens)
        record = await self.index.get(ctx.tenant, ctx.session) if self.reuse else None
        gen = GenerationRequest(
            model=chat.model,
            prompt_ids=rendered.ids,
            sampling=sampling,
            namespace=ctx.tenant,
            session=ctx.session,
            hint_keys=tuple(record.chunk_keys) if record and record.replica != self.replica else (),
            # A truncated turn may move the kept turns' KV out of the session's previous sequence.
            previous_keys=tuple(record.chunk_keys) if record and rendered.dropped_messages else (),
            reuse=self.reuse,
        )
        try:
            job = await self._submit(gen)
        except QueueFull as exc:
            if self.overflow is not None:
                return await self.overflow(request, chat, ctx)
            raise APIError(503, f"{exc}; retry later", code="queue_full") from None
        try:
            return await self._respond(request, chat, ctx, job)
        finally:
            if not job.done:
                job.cancel()

    async def _submit(self, gen: GenerationRequest) -> Job:
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

    async def _respond(
        self, request: web.Request, chat: ChatRequest, ctx: RequestContext, job: Job
    ) -> web.StreamResponse:
        events = job.events()
        first = await anext(events)
        if isinstance(first, Failed):
            raise APIError(first.status, first.message, code=first.code, type_="server_error")
        assert isinstance(first, FirstToken)
        ttft_ms = (first.at - ctx.received_at) * 1000.0
        cache = cache_level(first.tier, first.reused_tokens)
        headers = store_headers(
            cache=cache,
            route="local",
            reused=first.reused_tokens,
            session=ctx.session,
            ttft_ms=ttft_ms,
            replica=self.replica,
            tiers=first.tiers,
            position_shift=first.position_shift,
        )
        ids = fmt.CompletionIds(
            model=chat.model, system_fingerprint=f"fp_attnstore_{self._fingerprint(chat)}"
        )
        record = functools.partial(
            self._record, ctx, cache=cache, ttft_ms=ttft_ms, shift=first.position_shift
        )
        if not chat.stream:
            return await self._collect(ids, headers, events, record)
        response = web.StreamResponse(headers={**headers, "Cache-Control": "no-cache"})
        response.content_type = "text/event-stream"
        await response.prepare(request)
        await self._stream(response, chat, ids, events, record)
        return response

    async def _stream(
        self, resp: web.StreamResponse, chat: ChatRequest, ids, events, record: OnFinish
    ) -> None:
        usage_on = chat.include_usage
        await resp.write(
            fmt.chunk(ids, {"role": "assistant", "content": "", "refusal": None}, include_usage=usage_on)
        )
        async for event in events:
            if isinstance(event, TextDelta):
                await resp.write(fmt.chunk(ids, {"content": event.text}, include_usage=usage_on))
            elif isinstance(event, Finished):
                # Recorded before the client sees the end, so its next turn finds the session indexed.
                await record(event)
                await resp.write(fmt.chunk(ids, {}, event.finish_reason, include_usage=usage_on))
                if usage_on:
                    usage = fmt.usage(event.prompt_tokens, event.completion_tokens, event.reused_tokens)
                    await resp.write(fmt.chunk(ids, None, include_usage=True, usage_=usage))
                await resp.write(fmt.DONE)
            elif isinstance(event, Failed):
                # The headers are sent already: report the error in-band, as OpenAI does mid-stream.
                await resp.write(b"data: " + error_body(event.message, "server_error") + b"\n\n")
        await resp.write_eof()

    async def _collect(self, ids, headers, events, record: OnFinish) -> web.StreamResponse:
        parts: list[str] = []
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
            elif isinstance(event, Finished):
                await record(event)
                usage = fmt.usage(event.prompt_tokens, event.completion_tokens, event.reused_tokens)
                body = fmt.completion(ids, "".join(parts), event.finish_reason, usage)
                return web.json_response(body, headers=headers, dumps=_dumps)
            elif isinstance(event, Failed):
                return error_response(APIError(500, event.message, type_="server_error"), headers)
        raise AssertionError("job ended without Finished or Failed")

    async def _record(
        self, ctx: RequestContext, done: Finished, *, cache: CacheLevel, ttft_ms: float, shift: int = 0
    ) -> None:
        label = cache_label(cache)
        log_turn(
            session=ctx.session,
            turn=ctx.turn,
            cache=label,
            reused=done.reused_tokens,
            prompt=done.prompt_tokens,
            ttft_ms=ttft_ms,
            shift=shift,
        )
        self.metrics.observe_turn(
            route="local", cache=label, reused=done.reused_tokens, prompt=done.prompt_tokens, ttft_ms=ttft_ms
        )
        if self.reuse and done.chunk_keys:
            record = SessionRecord(
                replica=self.replica,
                tier="l0",
                chunk_keys=done.chunk_keys,
                tokens=done.prompt_tokens + done.completion_tokens,
            )
            await self.index.put(ctx.tenant, ctx.session, record)

    def _fingerprint(self, chat: ChatRequest) -> str:
        return self.runner.models[chat.model].fingerprint[:10]


def _dumps(obj) -> str:
    return fmt.orjson.dumps(obj).decode()
