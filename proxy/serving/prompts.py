"""Prompts -> token ids for every engine: a chat conversation through the model's chat template (with
truncation), or a completion's prompt as text or token ids.

Tokenizing is the first expensive step of a local turn, so it runs on a small pool of its own (the
default executor stays free) after the cheap character bound (`prompt_bound.precheck_prompt`) has
refused what cannot fit.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine_api.engine import Engine
from engine_api.prompt import PLAIN, PromptError, PromptFormat, RenderedPrompt, check_fits, fit_turn

from ..errors import APIError
from .prompt_bound import max_chars_per_token, precheck_prompt

T = TypeVar("T")


class PromptBuilder:
    def __init__(self, engine: Engine, *, truncate: bool, threads: int) -> None:
        self.engine = engine
        self.truncate = truncate
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="attnstore-tokenize")
        self._chars_per_token: dict[str, int] = {}

    async def _on_pool(self, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn)
        except PromptError as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None

    async def _chars_bound(self, model: str) -> int:
        per_token = self._chars_per_token.get(model)
        if per_token is None:
            per_token = await self._on_pool(lambda: max_chars_per_token(self.engine.tokenizer(model)))
            self._chars_per_token[model] = per_token
        return per_token

    async def chat(
        self,
        model: str,
        messages: Sequence[dict[str, Any]],
        reserve: int,
        chat: PromptFormat = PLAIN,
        *,
        may_truncate: bool = True,
    ) -> RenderedPrompt:
        """The conversation through the model's chat template, `reserve` tokens left for the answer; a
        prompt that certainly cannot fit is refused before tokenizing. Its oldest turns are dropped to
        fit where the server truncates on overflow and the request allows it (`may_truncate`)."""
        truncate = self.truncate and may_truncate
        limit = self.engine.context_limit(model)
        kept = precheck_prompt(
            model,
            messages,
            limit=limit,
            max_chars_per_token=await self._chars_bound(model),
            truncate=truncate,
        )

        def render() -> RenderedPrompt:
            rendered = fit_turn(
                self.engine.tokenizer(model),
                kept,
                model=model,
                limit=limit,
                reserve=reserve,
                truncate=truncate,
                chat=chat,
            )
            # Messages the character bound dropped before tokenizing count as dropped too.
            return dataclasses.replace(
                rendered, dropped_messages=rendered.dropped_messages + len(messages) - len(kept)
            )

        return await self._on_pool(render)

    async def text(self, model: str, prompt: str | list[int], reserve: int) -> RenderedPrompt:
        """A completion's prompt: text as the tokenizer encodes it (its BOS where the model has one),
        token ids as they are (checked against the vocabulary). No truncation: a completion's prompt
        has no turns to drop."""
        limit = self.engine.context_limit(model)
        if isinstance(prompt, str):
            bound = await self._chars_bound(model) * limit
            if len(prompt) > bound:
                raise APIError(
                    400,
                    f"the prompt cannot fit: it has {len(prompt)} characters; {model} takes at most "
                    f"{limit} tokens here",
                    param="prompt",
                    code="context_length_exceeded",
                )

        def render() -> RenderedPrompt:
            tokenizer = self.engine.tokenizer(model)
            if isinstance(prompt, str):
                ids = list(tokenizer.encode(prompt))
            else:
                vocab = len(tokenizer)
                bad = next((t for t in prompt if not 0 <= t < vocab), None)
                if bad is not None:
                    raise PromptError(
                        f"token id {bad} is not in {model}'s vocabulary (0-{vocab - 1})", "prompt"
                    )
                ids = list(prompt)
            if not ids:
                raise PromptError("'prompt' must not be empty", "prompt")
            check_fits(
                ids, model=model, limit=limit, reserve=max(1, min(reserve, limit // 4)), param="prompt"
            )
            return RenderedPrompt(ids)

        return await self._on_pool(render)

    def close(self) -> None:
        """Tokenizing still queued is dropped."""
        self.pool.shutdown(wait=False, cancel_futures=True)
