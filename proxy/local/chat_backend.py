"""Serve a chat turn on the local runner: render, reuse stored KV, stream OpenAI chunks, record the session.

The headers go out with the first token (they carry its TTFT and hit level: the `Turn` makes them from
what the runner reports), so a streamed response is prepared only once the runner reports the prompt
processed. A client that goes away cancels its job. Admission (per-client limit, a full queue) is
`admission.py`'s.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeGuard

from aiohttp import web

from kvtier import TIERS, Tier
from local_runner.admission import QueueFull
from local_runner.jobs import Event, Failed, Finished, FirstToken, GenerationRequest, Job, TextDelta
from local_runner.params import SamplingParams
from local_runner.prompt import PromptError
from local_runner.runner import RenderedPrompt, Runner, RunnerStats

from .. import openai_format as fmt
from ..chat_request import ChatRequest
from ..errors import APIError, error_body
from ..headers import CacheLevel
from ..limits import max_chars_per_token, precheck_prompt
from ..session_index import SessionIndex, SessionRecord
from ..turn import Turn
from .admission import LocalAdmission, refused
from .options import sampling_params, unsupported_reason

OnFinish = Callable[[Finished], Awaitable[None]]


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
    """The real `proxy.backend.LocalBackend`: turns run on the local runner, admitted by `admission`."""

    def __init__(
        self,
        runner: Runner,
        index: SessionIndex,
        admission: LocalAdmission,
        *,
        replica: str,
        reuse: bool = True,
        default_max_tokens: int = 512,
        tokenize_threads: int = 2,
        truncate_on_overflow: bool = False,
    ):
        self.runner = runner
        self.index = index
        self.admission = admission
        self.replica = replica
        self.reuse = reuse
        self.default_max_tokens = default_max_tokens
        self.truncate_on_overflow = truncate_on_overflow
        # The prompt bound (proxy/limits.py) before the expensive work, and a small pool of its own for
        # tokenizing (the default executor stays free).
        self.tokenize_pool = ThreadPoolExecutor(tokenize_threads, thread_name_prefix="attnstore-tokenize")
        self._chars_per_token: dict[str, int] = {}

    # -- the seam's questions ------------------------------------------------------------------------

    def supports(self, chat: ChatRequest) -> str | None:
        if not self.runner.serves(chat.model):
            return f"model {chat.model!r} is not served locally"
        return unsupported_reason(chat.body)

    def load(self) -> int:
        return self.runner.queue_depth + self.runner.running

    def max_context_tokens(self) -> int:
        return max((self.runner.context_limit(m) for m in self.runner.models), default=0)

    def describe(self) -> dict[str, Any]:
        return self.runner.describe()

    def stats(self) -> RunnerStats:
        return self.runner.stats()

    def forget_session(self, tenant: str, session: str) -> int:
        return self.runner.forget_session(tenant, session)

    def close(self) -> None:
        """The runner's worker stops and the stores' pending L2 writes finish (a restart finds every
        chunk); tokenizing still queued is dropped."""
        self.runner.close()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # -- one turn --------------------------------------------------------------------------------------

    async def handle(self, request: web.Request, chat: ChatRequest, turn: Turn) -> web.StreamResponse:
        sampling = sampling_params(chat.body, self.default_max_tokens)
        return await self._handle(request, chat, turn, sampling)

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
        self, request: web.Request, chat: ChatRequest, turn: Turn, sampling: SamplingParams
    ) -> web.StreamResponse:
        rendered = await self._tokenize(chat, sampling.max_tokens)
        record = await self.index.get(turn.tenant, turn.session) if self.reuse else None
        gen = GenerationRequest(
            model=chat.model,
            prompt_ids=rendered.ids,
            sampling=sampling,
            namespace=turn.tenant,
            session=turn.session,
            hint_keys=tuple(record.chunk_keys) if record and record.replica != self.replica else (),
            # A truncated turn may move the kept turns' KV out of the session's previous sequence.
            previous_keys=tuple(record.chunk_keys) if record and rendered.dropped_messages else (),
            reuse=self.reuse,
        )
        try:
            job = await self.admission.submit(request, gen)
        except QueueFull as exc:
            return await self.admission.queue_full(request, chat, turn, exc)
        try:
            events = job.events()
            first = await anext(events)
            if isinstance(first, Failed) and first.code == "queue_full":  # a hit took its place
                return await self.admission.queue_full(request, chat, turn, QueueFull(first.message))
            return await self._respond(request, chat, turn, job, first, events)
        finally:
            if not job.done:
                job.cancel()

    async def _respond(
        self,
        request: web.Request,
        chat: ChatRequest,
        turn: Turn,
        job: Job,
        first: Event,
        events: AsyncIterator[Event],
    ) -> web.StreamResponse:
        if isinstance(first, Failed):
            raise refused(first)
        assert isinstance(first, FirstToken)
        turn.local_first_token(
            cache=cache_level(first.tier, first.reused_tokens),
            reused=first.reused_tokens,
            prompt=len(job.request.prompt_ids),
            tiers=first.tiers,
            position_shift=first.position_shift,
            at=first.at,
        )
        ids = fmt.CompletionIds(
            model=chat.model, system_fingerprint=f"fp_attnstore_{self._fingerprint(chat)}"
        )
        record = functools.partial(self._record, turn)
        if not chat.stream:
            return await self._collect(ids, turn.headers(), events, record)
        response = web.StreamResponse(headers={**turn.headers(), "Cache-Control": "no-cache"})
        response.content_type = "text/event-stream"
        await response.prepare(request)
        await self._stream(response, chat, ids, events, record)
        return response

    async def _stream(
        self,
        resp: web.StreamResponse,
        chat: ChatRequest,
        ids: fmt.CompletionIds,
        events: AsyncIterator[Event],
        record: OnFinish,
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

    async def _collect(
        self,
        ids: fmt.CompletionIds,
        headers: dict[str, str],
        events: AsyncIterator[Event],
        record: OnFinish,
    ) -> web.StreamResponse:
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
                raise APIError(500, event.message, type_="server_error")
        raise AssertionError("job ended without Finished or Failed")

    async def _record(self, turn: Turn, done: Finished) -> None:
        """The turn is complete: its log line and metrics, and the session indexed for its next turn."""
        turn.finish(prompt=done.prompt_tokens, reused=done.reused_tokens)
        if self.reuse and done.chunk_keys:
            record = SessionRecord(
                replica=self.replica,
                tier="l0",
                chunk_keys=done.chunk_keys,
                tokens=done.prompt_tokens + done.completion_tokens,
            )
            await self.index.put(turn.tenant, turn.session, record)

    def _fingerprint(self, chat: ChatRequest) -> str:
        return self.runner.models[chat.model].fingerprint[:10]


def _dumps(obj: Any) -> str:
    return fmt.orjson.dumps(obj).decode()
