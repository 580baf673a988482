"""The embedded engine (`local_runner.Runner`) seen by the serving layer (`proxy.serving.engine.Engine`).

The runner decides admission (local_runner/admission.py: one queue per client, round-robin, bounded by
running slots + queue places); its QueueFull and OverShare are the serving layer's own, so they pass
through as they are. This adapter adds cost-aware routing's look: when the upstream could serve a turn,
the turn is looked up first: a hit (at least half its prompt stored) that finds the queue full takes the
place of a waiting miss, which goes upstream instead (its first event is `queue_full`), so hits stay
where they are cheap.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from transformers import PreTrainedTokenizerBase

from engine_api.errors import QueueFull, counts_as_hit
from engine_api.stats import EngineStats
from engine_api.turn import Event, Failed, GenerationRequest
from local_runner.grammars import Grammars
from local_runner.runner import Runner


class EmbeddedEngine:
    record_tier = "l0"  # a finished turn's KV stays in the runner's device tier

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.grammars = {name: Grammars(lm) for name, lm in runner.models.items()}

    def serves(self, model: str) -> bool:
        return self.runner.serves(model)

    def tokenizer(self, model: str) -> PreTrainedTokenizerBase:
        return self.runner.models[model].tokenizers.get()

    def context_limit(self, model: str) -> int:
        return self.runner.context_limit(model)

    def max_context_tokens(self) -> int:
        return max((self.runner.context_limit(m) for m in self.runner.models), default=0)

    def fingerprint(self, model: str) -> str:
        return self.runner.models[model].fingerprint[:10]

    async def run(self, gen: GenerationRequest, *, may_overflow: bool) -> AsyncGenerator[Event, None]:
        if gen.sampling.grammar is not None:
            compiled = await asyncio.to_thread(self.grammars[gen.model].compile, gen.sampling.grammar)
            gen = dataclasses.replace(gen, compiled_grammar=compiled)
        hit = False
        if may_overflow:
            reusable = await asyncio.to_thread(self.runner.reusable_tokens, gen)
            hit = counts_as_hit(reusable, len(gen.prompt_ids))
            gen = dataclasses.replace(gen, may_overflow=not hit)
        job = self.runner.submit(gen, hit=hit)  # QueueFull / OverShare: the serving layer answers them
        try:
            async for event in job.events():
                if isinstance(event, Failed) and event.code == "queue_full":  # a hit took its place
                    raise QueueFull(event.message)
                yield event
        finally:
            if not job.done:
                job.cancel()

    def load(self) -> int:
        return self.runner.queue_depth + self.runner.running

    def describe(self) -> dict[str, Any]:
        return self.runner.describe()

    def stats(self) -> EngineStats:
        return self.runner.stats()

    def forget_session(self, tenant: str, session: str) -> int:
        return self.runner.forget_session(tenant, session)

    async def aclose(self) -> None:
        return None

    def close(self) -> None:
        """The worker stops and the stores' pending L2 writes finish (a restart finds every chunk)."""
        self.runner.close()
