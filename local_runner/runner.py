"""The local runner's face to the proxy: which models it serves, prompt rendering, job submission, stats.

A thin facade over `engine.Engine`, which owns the steps, pools, stores, scheduler and the worker loop;
what the proxy (and the tests and benchmarks) call is here, what runs a turn is there."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from engine_api.prompt import RenderedPrompt, fit_turn
from engine_api.stats import EngineStats
from engine_api.turn import GenerationRequest
from kvtier import KVStore

from .config import RunnerConfig
from .engine import Engine
from .jobs import Job
from .loader import LoadedModel
from .model_step import ModelStep


class Runner:
    """What the proxy calls: the served models, prompt rendering, submission, stats and close. Builds
    its `Engine` from one `RunnerConfig` and starts it; everything else is the engine's."""

    def __init__(
        self,
        models: Mapping[str, LoadedModel],
        stores: Mapping[str, KVStore] | None = None,
        config: RunnerConfig | None = None,
    ):
        """`config`: every option (RunnerConfig's defaults without one)."""
        self.engine = Engine(models, stores, config)
        self.engine.start()

    @property
    def config(self) -> RunnerConfig:
        return self.engine.config

    @property
    def models(self) -> Mapping[str, LoadedModel]:
        return self.engine.models

    @property
    def stores(self) -> Mapping[str, KVStore]:
        return self.engine.stores

    @property
    def steps(self) -> Mapping[str, ModelStep]:
        """Each model's step (how it runs: packed, compiled; read-only)."""
        return self.engine.steps

    def serves(self, model: str) -> bool:
        return model in self.engine.models

    def context_limit(self, model: str) -> int:
        """Prompt + answer tokens a job may hold: the model's context, or less where settings (or, on
        CUDA, the device memory for its KV slots) say so."""
        return self.engine.context_limit(model)

    def render(self, model: str, messages: Sequence[dict[str, Any]], reserve: int = 1) -> list[int]:
        """Prompt token ids, leaving `reserve` tokens of the context for the answer (see render_turn)."""
        return self.render_turn(model, messages, reserve).ids

    def render_turn(self, model: str, messages: Sequence[dict[str, Any]], reserve: int = 1) -> RenderedPrompt:
        """The prompt, leaving `reserve` tokens of the context for the answer.

        A conversation that has outgrown the context loses its oldest whole turns (system messages and
        the last message stay) when truncate_on_overflow is set, cut with headroom where its later turns
        cut too (prompt.fit_history); otherwise it is refused with PromptError, as is content the
        runner cannot serve."""
        tokenizer = self.engine.models[model].tokenizers.get()
        limit = self.context_limit(model)
        truncate = self.engine.config.truncate_on_overflow
        return fit_turn(tokenizer, messages, model=model, limit=limit, reserve=reserve, truncate=truncate)

    def submit(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None, *, hit: bool = False
    ) -> Job:
        """Queue a job in its client's queue (admission.py: QueueFull when nothing can take it, OverShare
        past the client's share while others wait). `hit`: its KV is stored here; at a full queue it may
        take the place of a waiting miss the upstream can serve. Its answer is capped so that prompt +
        answer fit the model's context (`Job.max_tokens`)."""
        return self.engine.submit(request, loop or asyncio.get_running_loop(), hit=hit)

    @property
    def queue_depth(self) -> int:
        return self.engine.scheduler.queue_depth()

    @property
    def running(self) -> int:
        return self.engine.running

    @property
    def cancelled(self) -> int:
        return self.engine.scheduler.counts().cancelled

    def waiting_jobs(self) -> list[Job]:
        """The waiting jobs in the order they will be admitted (round-robin between clients)."""
        return self.engine.scheduler.window()

    def stats(self) -> EngineStats:
        """A snapshot of the queue and of every model's store; safe from any thread (the stores lock
        themselves), but it may wait on a store's lock, so call it off the event loop."""
        scheduler = self.engine.scheduler.counts()
        shifted_turns, shifted_tokens = self.engine.counters.shift_stats.snapshot()
        return EngineStats(
            queued=scheduler.queued,
            running=self.running,
            cancelled=scheduler.cancelled,
            stores={name: store.stats() for name, store in self.engine.stores.items()},
            shifted_turns=shifted_turns,
            shifted_tokens=shifted_tokens,
            admitted=scheduler.admitted,
            queue_wait_seconds=scheduler.queue_wait_seconds,
            waiting_clients=scheduler.waiting_clients,
            forked_tokens=self.engine.counters.forked_tokens,
        )

    def describe(self) -> dict[str, dict[str, object]]:
        """Per served model: where and how it runs (for /healthz)."""
        return {name: step.describe() for name, step in self.engine.steps.items()}

    def reusable_tokens(self, request: GenerationRequest) -> int:
        """Prompt tokens of this request whose KV is stored now (a look, not counted as a hit or miss).
        Blocking (the store's lock, perhaps a file header): call it off the event loop."""
        store = self.engine.stores.get(request.model)
        if store is None or not request.reuse:
            return 0
        ids = request.prompt_ids[:-1]
        return store.lookup(request.namespace, ids, hint_keys=request.hint_keys, count=False).tokens

    def forget_session(self, namespace: str, session: str) -> int:
        """Drop one tenant's session from every model's store; returns the chunks dropped. Blocking."""
        return sum(store.forget_session(namespace, session) for store in self.engine.stores.values())

    def close(self) -> None:
        """Stop the engine's loop, then close its stores and free its pools."""
        self.engine.close()
