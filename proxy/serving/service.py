"""`LocalServing`: the proxy's one `LocalBackend`, above whichever engine runs the turns.

A local turn, for every API and every engine:

1. sampling options validated (`options.py`), the prompt rendered to token ids (`prompts.py`: the chat
   template with truncation, or a completion's text or ids);
2. the session's record looked up (another replica's chunk keys are hints for the shared L2; a
   truncated turn's previous keys let its stored KV move);
3. the engine runs it (`engine.Engine.run`); at its first step a full queue sends a miss upstream when
   the upstream serves the model (cost-aware routing), else 503; past a client's share, 429; a turn
   the engine refuses gets the error it names;
4. at the first token the `Turn` learns what was reused (its X-AttentionStore-* headers go out with
   the answer), and the answer is written in the API's shape (`answers.py`);
5. before the client sees the end: the log line and metrics (`Turn.finish`), the session indexed with
   the chunk keys the turn saved, the session retained in the store when the answer ended in tool calls
   or the request carried a retention hint (`retention.py`), and for the Responses API the response
   stored by its id.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import math
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeGuard

import orjson
from aiohttp import web

from engine_api.engine import Engine
from engine_api.errors import EngineError, OverShare, QueueFull
from engine_api.prompt import PromptFormat, RenderedPrompt, render_prompt
from engine_api.turn import Event, Failed, Finished, FirstToken, GenerationRequest
from kvtier.tier_names import TIERS, Tier

from ..anthropic.content import CACHE_TTLS
from ..anthropic.messages import CacheAccounting
from ..anthropic.requests import MessagesRequest
from ..cluster.session_index import SessionIndex, SessionRecord
from ..errors import APIError
from ..openai import responses as responses_wire
from ..openai.requests import ApiRequest, ChatRequest, CompletionRequest, ResponsesRequest
from ..openai.tool_pairing import check_chat_tool_replies, check_responses_tool_outputs
from ..settings import Settings, chat_templates, replica_id
from ..turns.headers import CacheLevel
from ..turns.tenant import ANONYMOUS, tenant_of
from ..turns.turn import Turn
from .answers import Answer, ChatAnswer, CompletionAnswer, ResponsesAnswer, write_answer
from .choices import fan_out
from .messages_answer import MessagesAnswer
from .options import ChatSetup, sampling_params, unsupported_reason
from .prompts import PromptBuilder
from .response_store import ResponseStore, StoredResponse
from .retention import RetentionPolicy
from .structured import response_format_grammar, text_format_grammar
from .tools import (
    ToolCallParser,
    ToolRequest,
    call_or_answer_grammar,
    constrained_calls_grammar,
    detect_parser,
    forced_call_grammar,
    renders_tools,
    responses_tool_request,
    tool_request,
)

# Where a turn goes when the local queue is full (`upstream.upstream_fallback`): its answer, or an APIError.
UpstreamFallback = Callable[[web.Request, ApiRequest, Turn], Awaitable[web.StreamResponse]]


def client_id(request: web.Request) -> str:
    """The tenant (a hash of the key), or the remote address for a caller without a key: admission is
    fair per client."""
    tenant = tenant_of(request.headers)
    return tenant if tenant != ANONYMOUS else f"addr:{request.remote or '?'}"


def too_many(message: str, retry_after_s: float | None) -> APIError:
    """429 past a client's fair share of the local queue, with when to retry."""
    seconds = max(1, math.ceil(retry_after_s or 1))
    return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": str(seconds)})


def refused(failed: Failed) -> APIError:
    """A turn that ended before its first token: the error the client gets."""
    if failed.status == 429:
        return too_many(failed.message, failed.retry_after_s)
    return APIError(failed.status, failed.message, code=failed.code, type_="server_error")


def _is_tier(name: str) -> TypeGuard[Tier]:
    return name in TIERS


def cache_level(tier: str | None, reused: int) -> CacheLevel:
    """The slowest tier the turn reused KV from, or "miss" when it reused nothing."""
    if not (tier and reused):
        return "miss"
    if not _is_tier(tier):
        raise ValueError(f"the engine reported an unknown tier {tier!r}")
    return tier


def _served(req: ApiRequest) -> ApiRequest:
    """What the engines serve for `req`: a Messages request's chat form, any other request itself."""
    return req.as_chat if isinstance(req, MessagesRequest) else req


def _tools(served: ApiRequest) -> ToolRequest | None:
    """The tools of a chat turn (or a Messages turn's chat form) or of a Responses turn, validated."""
    if isinstance(served, ChatRequest):
        return tool_request(served.body)
    if isinstance(served, ResponsesRequest):
        return responses_tool_request(served.body)
    return None


def _check_tool_pairing(req: ApiRequest) -> None:
    """A local turn's tool results answer calls its conversation made, and its calls are answered, as
    OpenAI requires (a Messages request met Anthropic's rule as its content was converted)."""
    if isinstance(req, ChatRequest):
        check_chat_tool_replies(req.messages)
    elif isinstance(req, ResponsesRequest):
        check_responses_tool_outputs(req.conversation)


def _format_source(req: ApiRequest) -> object:
    """What `_answer_format` reads of the request (None: no format asked)."""
    if isinstance(req, ChatRequest):
        return req.body.get("response_format")
    if isinstance(req, ResponsesRequest):
        return req.body.get("text")
    return None


# How many distinct grammars a LocalServing remembers (each a few KB to some 100 KB of EBNF text).
GRAMMARS_REMEMBERED = 256


def _answer_format(req: ApiRequest) -> str | None:
    """The grammar of the answer's format: chat's `response_format`, the Responses API's `text.format`."""
    if isinstance(req, ChatRequest):
        return response_format_grammar(req.body)
    if isinstance(req, ResponsesRequest):
        return text_format_grammar(req.body)
    return None


class LocalServing:
    def __init__(
        self,
        engine: Engine,
        index: SessionIndex,
        *,
        replica: str,
        reuse: bool,
        default_max_tokens: int,
        truncate_on_overflow: bool,
        tokenize_threads: int = 2,
        overflow: UpstreamFallback | None = None,
        upstream_model: str = "",
        max_stored_responses: int = 10_000,
        chat_templates: Mapping[str, str] | None = None,
        tool_call_parsers: Mapping[str, str] | None = None,
        chunk_tokens: int = 0,
        retention: RetentionPolicy | None = None,
    ) -> None:
        self.engine = engine
        self.prompts = PromptBuilder(engine, truncate=truncate_on_overflow, threads=tokenize_threads)
        self.index = index
        self.responses = ResponseStore(index, max_stored_responses)
        self.replica = replica
        self.reuse = reuse
        self.default_max_tokens = default_max_tokens
        self.overflow = overflow  # None: a full queue is a 503
        self.upstream_model = upstream_model  # the model the upstream serves too ("": none)
        self._templates = dict(chat_templates or {})  # served model -> its chat template's text
        self._parsers = dict(tool_call_parsers or {})  # served model -> its tool-call format
        self.retention = retention  # None: no session is retained (hints are ignored)
        self._setups: dict[str, ChatSetup] = {}
        self._grammars: OrderedDict[bytes, str | None] = OrderedDict()  # see `_grammar`
        # What the store keeps of a turn, for Anthropic's cache usage (whole chunks, when reuse is on).
        self.accounting = CacheAccounting(chunk_tokens, stores=reuse)

    def setup(self, model: str) -> ChatSetup:
        """What the model's chat template does (looked at once per model: two renders of a probe)."""
        found = self._setups.get(model)
        if found is None:
            template = self._templates.get(model)
            tokenizer = self.engine.tokenizer(model)

            def render(messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...]) -> list[int]:
                return render_prompt(tokenizer, messages, PromptFormat(tools, template))

            source = template or str(getattr(tokenizer, "chat_template", "") or "")
            parser = self._parsers.get(model) or detect_parser(source)
            tools = renders_tools(render, [{"role": "user", "content": "hi"}])
            found = self._setups[model] = ChatSetup(template, tools, parser)
        return found

    @classmethod
    def from_settings(
        cls,
        engine: Engine,
        settings: Settings,
        index: SessionIndex,
        *,
        overflow: UpstreamFallback | None,
        base_dir: Path,
    ) -> LocalServing:
        """The serving layer above `engine`, configured from settings: the same for every engine. Called
        as local serving starts, off the event loop: xgrammar is imported here, where the first turn with
        tools or a format would import it on the loop, every stream waiting (docs/benchmarks.md,
        "Constrained decoding and tool parsing")."""
        importlib.import_module("xgrammar")
        upstream = settings.llm_endpoint
        return cls(
            engine,
            index,
            replica=replica_id(settings),
            reuse=settings.attention_store.enabled,
            default_max_tokens=settings.local_runner.max_tokens_default,
            truncate_on_overflow=settings.attention_store.position_encoding.truncate_on_overflow,
            tokenize_threads=settings.proxy.tokenize_threads,
            overflow=overflow,
            upstream_model=upstream.model if upstream.base_url else "",
            max_stored_responses=settings.proxy.max_stored_responses,
            chat_templates=chat_templates(settings, base_dir),
            tool_call_parsers=settings.local_runner.tool_call_parsers,
            chunk_tokens=settings.local_runner.kv_chunk_tokens,
            retention=RetentionPolicy.from_settings(settings),
        )

    # -- the seam's questions (the rest is the engine's: `self.engine`) --------------------------------

    def supports(self, req: ApiRequest) -> str | None:
        if not self.engine.serves(req.model):
            return f"model {req.model!r} is not served locally"
        if isinstance(req, MessagesRequest) and req.unserved:
            return req.unserved
        return unsupported_reason(_served(req), self.setup(req.model))

    async def count_prompt_tokens(self, req: ApiRequest) -> int:
        """The prompt tokens a turn of this request would have (its conversation and tools rendered as
        the turn renders them), without running it: Anthropic's count_tokens."""
        served = _served(req)
        tools = _tools(served)
        return len((await self._render(served, 1, tools)).ids)

    async def aclose(self) -> None:
        await self.engine.aclose()

    def close(self) -> None:
        """The engine stops (its pending L2 writes finish, so a restart finds every chunk); tokenizing
        still queued is dropped."""
        self.engine.close()
        self.prompts.close()

    # -- one turn --------------------------------------------------------------------------------------

    async def _render(self, req: ApiRequest, reserve: int, tools: ToolRequest | None) -> RenderedPrompt:
        if isinstance(req, CompletionRequest):
            assert req.prompt is not None  # supports() sent a batch of prompts elsewhere
            return await self.prompts.text(req.model, req.prompt, reserve)
        if isinstance(req, ChatRequest | ResponsesRequest):
            rendered_tools = tools.tools if tools is not None and tools.choice != "none" else ()
            chat = PromptFormat(rendered_tools, self.setup(req.model).template)
            may_truncate = not isinstance(req, ResponsesRequest) or req.truncate
            return await self.prompts.chat(req.model, req.messages, reserve, chat, may_truncate=may_truncate)
        raise TypeError(f"no local serving for {type(req).__name__}")

    def _grammar(self, req: ApiRequest, tools: ToolRequest | None) -> str | None:
        """`_build_grammar`'s answer, remembered for the recent turns' tools and formats: an agent sends
        the same every turn, and building one holds the event loop for milliseconds (xgrammar: every
        stream waits meanwhile) where a lookup takes microseconds (docs/benchmarks.md, "Constrained
        decoding and tool parsing"). Refusals are not remembered."""
        source = _format_source(req)
        if tools is None and source is None:
            return None
        key = orjson.dumps([req.model, type(req).__name__, source, tools.grammar_inputs() if tools else None])
        if key in self._grammars:
            self._grammars.move_to_end(key)
            return self._grammars[key]
        grammar = self._build_grammar(req, tools)
        self._grammars[key] = grammar
        if len(self._grammars) > GRAMMARS_REMEMBERED:
            self._grammars.popitem(last=False)
        return grammar

    def _build_grammar(self, req: ApiRequest, tools: ToolRequest | None) -> str | None:
        """The grammar the answer is decoded under: a forced tool call, else response_format's JSON (or
        a call, when the choice of one is free), else, with strict tools or allowed_tools, text whose
        calls follow their schemas and name an allowed function."""
        parser = self.setup(req.model).parser
        if tools is not None and tools.choice in ("required", "named"):
            assert parser is not None  # supports() sent tools without a parser elsewhere
            return forced_call_grammar(tools, parser)
        answer = _answer_format(req)
        if answer is not None and tools is not None and tools.choice == "auto" and parser is not None:
            return call_or_answer_grammar(tools, parser, answer)
        if answer is None and tools is not None and tools.choice == "auto" and tools.constrained and parser:
            return constrained_calls_grammar(tools, parser)
        return answer

    def _may_overflow(self, req: ApiRequest) -> bool:
        """Whether a miss at a full queue may go upstream instead. Never a Responses turn: its id (and
        the conversation stored by it) would then be the upstream's, unknown to its next turn here."""
        return (
            self.overflow is not None
            and bool(self.upstream_model)
            and self.upstream_model == req.model
            and not isinstance(req, ResponsesRequest)
        )

    async def handle(self, request: web.Request, req: ApiRequest, turn: Turn) -> web.StreamResponse:
        served = _served(req)  # a Messages turn is served as its chat form; answered in its own shape
        _check_tool_pairing(req)
        tools = _tools(served)
        vocab = len(self.engine.tokenizer(req.model))
        sampling = sampling_params(served, self.default_max_tokens, vocab=vocab)
        if isinstance(req, MessagesRequest):
            sampling.stop = list(req.stop_sequences)  # Anthropic allows more than OpenAI's four
        sampling.grammar = self._grammar(served, tools)
        parser = self.setup(req.model).parser
        if tools is not None and parser is not None:
            sampling.stop += tools.stops(parser)
        rendered = await self._render(served, sampling.max_tokens, tools)
        # A Responses turn continues the conversation its previous response holds.
        named = req.previous_response_id if isinstance(req, ResponsesRequest) else None
        record = await self.index.get(turn.tenant, named or turn.session) if self.reuse else None
        gen = GenerationRequest(
            model=req.model,
            prompt_ids=rendered.ids,
            sampling=sampling,
            namespace=turn.tenant,
            session=turn.session,
            hint_keys=tuple(record.chunk_keys) if record and record.replica != self.replica else (),
            # A truncated turn may move the kept turns' KV out of the session's previous sequence.
            previous_keys=tuple(record.chunk_keys) if record and rendered.dropped_messages else (),
            reuse=self.reuse,
            client=client_id(request),
        )
        may_overflow = self._may_overflow(req)
        events = self.engine.run(gen, may_overflow=may_overflow)
        try:
            try:
                first = await anext(events)
            except QueueFull as exc:
                if may_overflow and self.overflow is not None:
                    return await self.overflow(request, req, turn)
                raise APIError(503, f"{exc}; retry later", code="queue_full") from None
            except OverShare as exc:
                raise too_many(str(exc), exc.retry_after_s) from None
            except EngineError as exc:
                raise APIError(exc.status, exc.message, code=exc.code, type_=exc.type) from None
            if isinstance(first, Failed):
                raise refused(first)
            assert isinstance(first, FirstToken)
            turn.local_first_token(
                cache=cache_level(first.tier, first.reused_tokens),
                reused=first.reused_tokens,
                prompt=len(rendered.ids),
                tiers=first.tiers,
                position_shift=first.position_shift,
                at=first.at,
                skipped=first.skipped_tokens,
            )
            n = served.body.get("n") or 1
            answer = self._answer(req, turn, tools, sampling.logprobs is not None, n)

            async def on_finish(done: Finished) -> None:
                await self._finish(req, turn, answer, done)

            def run(fork: GenerationRequest) -> AsyncGenerator[Event, None]:
                return self.engine.run(fork, may_overflow=False)

            answers = fan_out(first, events, gen, n, run)
            try:
                return await write_answer(request, answer, turn.headers(), answers, on_finish)
            finally:
                await answers.aclose()  # the n answers' tasks end with it
        finally:
            await events.aclose()  # a turn left before its end (client gone, error) is cancelled

    def _answer(
        self, req: ApiRequest, turn: Turn, tools: ToolRequest | None, logprobs: bool, n: int
    ) -> Answer:
        fingerprint = f"fp_attnstore_{self.engine.fingerprint(req.model)}"
        parser = self.setup(req.model).parser
        parses_calls = bool(tools and tools.choice != "none" and parser)
        max_calls = tools.max_calls if tools is not None else None
        if isinstance(req, MessagesRequest):
            return MessagesAnswer(
                req.model,
                stream=req.stream,
                accounting=self.accounting,
                prompt=turn.prompt,
                reused=turn.reused,
                tools=ToolCallParser(parser, max_calls) if parses_calls and parser else None,
                stop_sequences=tuple(req.stop_sequences),
                hour=(req.retention_hint_s or 0) >= CACHE_TTLS["1h"],
            )
        if isinstance(req, ResponsesRequest):
            return ResponsesAnswer(
                responses_wire.ResponseShape.answering(turn.session, req),
                stream=req.stream,
                tools=ToolCallParser(parser, max_calls) if parses_calls and parser else None,
            )
        if isinstance(req, CompletionRequest):
            return CompletionAnswer(
                req.model, fingerprint, stream=req.stream, include_usage=req.include_usage, n=n
            )
        return ChatAnswer(
            req.model,
            fingerprint,
            stream=req.stream,
            include_usage=req.include_usage,
            n=n,
            tools=functools.partial(ToolCallParser, parser, max_calls) if parses_calls and parser else None,
            decode=self._decoder(req.model) if logprobs else None,
        )

    def _decoder(self, model: str) -> Callable[[int], str]:
        tokenizer = self.engine.tokenizer(model)  # this thread's (the event loop's)
        cache: dict[int, str] = {}

        def decode(token: int) -> str:
            text = cache.get(token)
            if text is None:
                text = cache[token] = str(tokenizer.decode([token]))
            return text

        return decode

    async def _finish(self, req: ApiRequest, turn: Turn, answer: Answer, done: Finished) -> None:
        """The turn is complete: its log line and metrics, the session indexed for its next turn, and a
        Responses turn's response stored by its id (before the client sees the end)."""
        turn.finish(prompt=done.prompt_tokens, reused=done.reused_tokens)
        if self.reuse and done.chunk_keys:
            record = SessionRecord(
                replica=self.replica,
                tier=self.engine.record_tier,
                chunk_keys=done.chunk_keys,
                tokens=done.prompt_tokens + done.completion_tokens,
            )
            await self.index.put(turn.tenant, turn.session, record)
        if self.reuse and self.retention is not None:
            seconds = self.retention.seconds(req.retention_hint_s, answer.ended_in_tool_calls())
            if seconds > 0:  # the store's lock (or, under vLLM, its socket): off the event loop
                await asyncio.to_thread(self.engine.retain, turn.tenant, turn.session, seconds)
        if isinstance(req, ResponsesRequest) and req.store:
            assert isinstance(answer, ResponsesAnswer)
            conversation = [*req.conversation, answer.as_message()]
            stored = StoredResponse(model=req.model, conversation=conversation, response=answer.body(done))
            await self.responses.put(turn.tenant, turn.session, stored)
