"""The vLLM engine, as the serving layer sees an engine (`engine_api.engine.Engine`): a turn's token
ids sent to the model's vLLM server, its stream read back as the engine's events (`engine_api.turn`).

A turn is sent as a streamed /v1/completions of those ids, with the tenant, the session and the turn's
id in `kv_transfer_params` (the connector, connector.py, keys the store by them) and the tenant as vLLM's
`cache_salt` (tenants never share vLLM's own cache either). At the first token the store's report for
the turn gives the reused tokens per tier (the `FirstToken`); at the end the keys the turn saved come
with the `Finished`. Admission: vLLM queues what it is sent, so this engine only bounds the turns in
flight (running + queue places); past them a miss is refused (QueueFull) while a hit (at least half its
prompt stored) still goes to vLLM, up to twice the bound. A request vLLM refuses, or a server that
cannot be reached, is an EngineError (the client's 400, or a 502).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from transformers import PreTrainedTokenizerBase

from engine_api.errors import EngineError, QueueFull, counts_as_hit
from engine_api.sampling import SamplingParams, TokenLogprob
from engine_api.stats import EngineStats
from engine_api.tokenizers import ThreadTokenizers
from engine_api.turn import Event, Failed, Finished, FirstToken, GenerationRequest, TextDelta
from kvtier import TIERS
from kvtier.tier_names import tier_rank

from .link.wire import AsyncStoreClient, StoreError, StoreUnavailable
from .server import VllmServer
from .store_view import forget, retain, store_stats
from .stream import Delta, Finish, StreamError, TokenUsage, completion_events

log = logging.getLogger("attnstore")
REPORT_WAIT_S = 2.0  # the store reports a turn before its first token; this covers a busy machine
SAVED_WAIT_S = 3.0  # the finished turn's save takes one engine step and a memory copy


@dataclass
class ServedModel:
    name: str
    server: VllmServer
    tokenizers: ThreadTokenizers
    limit: int  # prompt + answer tokens
    dtype: str
    store: AsyncStoreClient | None


class VllmEngine:
    record_tier = "l1"  # vLLM's paged memory is not kvtier's L0; the store keeps a saved turn in L1

    def __init__(
        self, models: dict[str, ServedModel], *, max_running: int, max_queue: int, timeout_s: float
    ) -> None:
        self.models = models
        self.max_running = max_running
        self.capacity = max_running + max_queue
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s)
        self._http: aiohttp.ClientSession | None = None  # made on the event loop, at the first turn
        self._in_flight = 0
        self._admitted = 0
        self._cancelled = 0

    # -- what the serving layer asks -----------------------------------------------------------------

    def serves(self, model: str) -> bool:
        return model in self.models

    def tokenizer(self, model: str) -> PreTrainedTokenizerBase:
        return self.models[model].tokenizers.get()

    def context_limit(self, model: str) -> int:
        return self.models[model].limit

    def max_context_tokens(self) -> int:
        return max((m.limit for m in self.models.values()), default=0)

    def fingerprint(self, model: str) -> str:
        return f"vllm_{self.models[model].dtype}"

    def load(self) -> int:
        return self._in_flight

    def describe(self) -> dict[str, Any]:
        return {
            name: {"engine": "vllm", "url": m.server.url, "dtype": m.dtype, "context": m.limit}
            for name, m in self.models.items()
        }

    def stats(self) -> EngineStats:
        running = min(self._in_flight, self.max_running)
        stores = {n: s for n, m in self.models.items() if (s := store_stats(m.server)) is not None}
        return EngineStats(
            queued=self._in_flight - running,
            running=running,
            cancelled=self._cancelled,
            stores=stores,
            admitted=self._admitted,
        )

    def forget_session(self, tenant: str, session: str) -> int:
        return sum(forget(m.server, tenant, session) for m in self.models.values())

    def retain(self, tenant: str, session: str, seconds: float) -> None:
        for m in self.models.values():
            retain(m.server, tenant, session, seconds)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()

    def close(self) -> None:
        """Flush every store and stop every vLLM (their whole process groups)."""
        for m in self.models.values():
            m.server.stop()

    # -- one turn --------------------------------------------------------------------------------------

    async def run(self, gen: GenerationRequest, *, may_overflow: bool) -> AsyncGenerator[Event, None]:
        model = self.models[gen.model]
        if self._in_flight >= self.capacity and not await self._hit_at_full_queue(model, gen):
            raise QueueFull("the local queue is full")
        turn_id = uuid.uuid4().hex
        if self._http is None:
            self._http = aiohttp.ClientSession()
        self._in_flight += 1
        self._admitted += 1
        try:
            async with self._http.post(
                model.server.url + "/v1/completions",
                json=_completion_body(model, gen, turn_id),
                timeout=self.timeout,
            ) as resp:
                if resp.status != 200:
                    raise await vllm_error(resp)
                async for event in self._events(model, gen, turn_id, completion_events(resp)):
                    yield event
        except asyncio.CancelledError:
            self._cancelled += 1  # the client went away: closing the stream aborts the request in vLLM
            raise
        except aiohttp.ClientError as exc:
            raise EngineError(502, f"vLLM for {gen.model} failed: {exc}", type_="server_error") from None
        finally:
            self._in_flight -= 1

    async def _events(
        self, model: ServedModel, gen: GenerationRequest, turn_id: str, stream: AsyncIterator[Any]
    ) -> AsyncIterator[Event]:
        """vLLM's stream as the engine's events: FirstToken when its first chunk arrives (with the
        store's report), then text, then Finished with the keys the store saved for the turn."""
        first: FirstToken | None = None
        reason, usage, stop_sequence = "stop", TokenUsage(0, 0), None
        try:
            async for item in stream:
                if first is None:
                    first = await self._first_token(model, turn_id, time.monotonic())
                    yield first
                if isinstance(item, Delta):
                    yield TextDelta(item.text, _top(item.logprobs, gen.sampling.logprobs))
                elif isinstance(item, Finish):
                    reason, stop_sequence = item.reason, item.stop_sequence
                elif isinstance(item, TokenUsage):
                    usage = item
                elif isinstance(item, StreamError):
                    yield Failed(f"vLLM: {item.message}", status=502)
                    return
        except aiohttp.ClientError as exc:
            if first is None:
                raise
            yield Failed(f"vLLM for {gen.model} failed mid-answer: {exc}", status=502)
            return
        if first is None:  # an empty stream: nothing was generated
            first = await self._first_token(model, turn_id, time.monotonic())
            yield first
        keys = await self._saved_keys(model, turn_id) if gen.reuse else []
        yield Finished(
            reason,
            usage.prompt_tokens,
            usage.completion_tokens,
            first.reused_tokens,
            keys,
            stop_sequence=stop_sequence,
        )

    async def _hit_at_full_queue(self, model: ServedModel, gen: GenerationRequest) -> bool:
        """At a full queue a turn whose prompt is at least half stored still runs here (cheap); vLLM
        queues it. Past twice the queue, nothing does."""
        if model.store is None or self._in_flight >= 2 * self.capacity:
            return False
        with contextlib.suppress(StoreUnavailable, StoreError):
            reply = await model.store.call("lookup", namespace=gen.namespace, tokens=gen.prompt_ids)
            stored = max((s + n for s, n, _ in reply["chunks"]), default=0)
            return counts_as_hit(stored, len(gen.prompt_ids))
        return False

    async def _first_token(self, model: ServedModel, turn_id: str, at: float) -> FirstToken:
        tiers: dict[str, int] = dict.fromkeys(TIERS, 0)
        if model.store is not None:
            try:
                report = await model.store.call("turn", turn=turn_id, wait_s=REPORT_WAIT_S)
            except (StoreUnavailable, StoreError) as exc:
                log.warning("attnstore: no reuse report for a turn of %s: %s", model.name, exc)
                report = None
            tiers.update((report or {}).get("tiers") or {})
        reused = sum(tiers.values())
        slowest: str | None = None
        if reused:
            slowest = max((t for t in TIERS if tiers[t] > 0), key=tier_rank)
        return FirstToken(reused_tokens=reused, tier=slowest, at=at, tiers=tiers)

    async def _saved_keys(self, model: ServedModel, turn_id: str) -> list[str]:
        """The chunk keys vLLM's store saved for the finished turn (for the session index)."""
        if model.store is None:
            return []
        try:
            entry = await model.store.call("turn", turn=turn_id, wait_s=SAVED_WAIT_S, saved=True)
        except (StoreUnavailable, StoreError):
            return []
        return list((entry or {}).get("keys") or [])


def _top(logprobs: list[TokenLogprob] | None, k: int | None) -> list[TokenLogprob] | None:
    """vLLM's alternatives (it may add the chosen token to them) cut to the k asked for."""
    if logprobs is None or k is None:
        return None
    return [TokenLogprob(lp.token, lp.logprob, lp.top[:k]) for lp in logprobs]


def _sampling_extras(sampling: SamplingParams) -> dict[str, Any]:
    """The options vLLM takes as they are: penalties, logit_bias, logprobs (token ids, not strings:
    the serving layer decodes them as for the embedded engine), and the grammar (vLLM's xgrammar)."""
    extras: dict[str, Any] = {
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
    }
    if sampling.top_k:
        extras["top_k"] = sampling.top_k
    if sampling.logit_bias:
        extras["logit_bias"] = {str(t): b for t, b in sampling.logit_bias.items()}
    if sampling.logprobs is not None:
        extras["logprobs"] = sampling.logprobs
        extras["return_tokens_as_token_ids"] = True
    if sampling.grammar is not None:
        extras["structured_outputs"] = {"grammar": sampling.grammar}
    return extras


def _completion_body(model: ServedModel, gen: GenerationRequest, turn_id: str) -> dict[str, Any]:
    sampling = gen.sampling
    return {
        **_sampling_extras(sampling),
        "model": gen.model,
        "prompt": gen.prompt_ids,
        "max_tokens": max(1, min(sampling.max_tokens, model.limit - len(gen.prompt_ids))),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "stop": sampling.stop or None,
        # ignore_eos decodes past the end of text, never past a grammar's end (the embedded engine's
        # rule): under a grammar the end of text comes only where the grammar ends, so it is dropped.
        "ignore_eos": sampling.ignore_eos and sampling.grammar is None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": f"attnstore-{gen.namespace}",
        "kv_transfer_params": {
            "attnstore": {
                "tenant": gen.namespace,
                "session": gen.session,
                "turn": turn_id,
                "reuse": gen.reuse,
                # What another replica stored for this session: its store adopts those files from L2.
                "hints": list(gen.hint_keys),
            }
        },
    }


async def vllm_error(resp: aiohttp.ClientResponse) -> EngineError:
    """vLLM refused the request: its 4xx is the client's (its message passed on), anything else a 502."""
    try:
        body = await resp.json(content_type=None)
        message = str(body.get("error", {}).get("message") or body)
    except (ValueError, aiohttp.ClientError, AttributeError):
        message = (await resp.text())[:500]
    if 400 <= resp.status < 500:
        return EngineError(400, f"vLLM: {message}", code="invalid_request")
    return EngineError(502, f"vLLM answered {resp.status}: {message}", type_="server_error")
