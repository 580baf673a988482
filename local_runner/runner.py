"""The local runner's face to the proxy: which models it serves, prompt rendering, job submission."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvtier import KVStore, StoreStats

from .engine import JobState
from .jobs import GenerationRequest, Job
from .kv_cache import job_cache
from .loader import LoadedModel
from .prompt import PromptError, render_prompt, truncate_history
from .worker import Worker


@dataclass(frozen=True)
class RunnerStats:
    queued: int
    running: int
    cancelled: int  # jobs stopped because their client went away
    stores: dict[str, StoreStats]  # per served model with a KV store


class Runner:
    def __init__(
        self,
        models: Mapping[str, LoadedModel],
        stores: Mapping[str, KVStore] | None = None,
        *,
        max_queue: int = 16,
        max_running: int = 4,
        lookahead: int = 1,
        prefill_chunk: int = 512,
        max_context_tokens: int | None = None,
        truncate_on_overflow: bool = False,
    ):
        self.models = dict(models)
        self.stores = dict(stores or {})
        self._prefill_chunk = prefill_chunk
        self._max_context = max_context_tokens
        self._truncate = truncate_on_overflow
        self._worker = Worker(
            self._start_job,
            self._prefetch,
            max_queue=max_queue,
            max_running=max_running,
            lookahead=lookahead,
            warmup=self._warmup,
        )

    def serves(self, model: str) -> bool:
        return model in self.models

    def context_limit(self, model: str) -> int:
        """Prompt + answer tokens a job may hold: the model's context, or less where settings say so."""
        limit = self.models[model].max_context
        return min(limit, self._max_context) if self._max_context else limit

    def render(self, model: str, messages: Sequence[dict[str, Any]], reserve: int = 1) -> list[int]:
        """Prompt token ids, leaving `reserve` tokens of the context for the answer.

        A conversation that has outgrown the context loses its oldest turns (system messages and the
        last message stay) when truncate_on_overflow is set; otherwise it is refused with PromptError,
        as is content the runner cannot serve."""
        lm = self.models[model]
        limit = self.context_limit(model)
        reserve = max(1, min(reserve, limit // 4))
        ids = render_prompt(lm.tokenizer, messages)
        if len(ids) + reserve > limit and self._truncate:
            ids = render_prompt(lm.tokenizer, truncate_history(lm.tokenizer, messages, limit - reserve))
        if len(ids) + reserve > limit:
            raise PromptError(
                f"the prompt has {len(ids)} tokens; {model} takes at most {limit - reserve} here",
                "messages",
                code="context_length_exceeded",
            )
        return ids

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> Job:
        """Queue a job (raises worker.QueueFull when the queue is full). max_tokens is capped so that
        prompt + answer fit the model's context."""
        room = self.context_limit(request.model) - len(request.prompt_ids)
        request.sampling.max_tokens = max(1, min(request.sampling.max_tokens, room))
        job = Job(request, loop or asyncio.get_running_loop())
        self._worker.submit(job)
        return job

    @property
    def queue_depth(self) -> int:
        return self._worker.queued

    @property
    def running(self) -> int:
        return self._worker.running

    @property
    def cancelled(self) -> int:
        return self._worker.cancelled

    def stats(self) -> RunnerStats:
        """A snapshot of the queue and of every model's store; safe from any thread (the stores lock
        themselves), but it may wait on a store's lock, so call it off the event loop."""
        return RunnerStats(
            queued=self.queue_depth,
            running=self.running,
            cancelled=self.cancelled,
            stores={name: store.stats() for name, store in self.stores.items()},
        )

    def forget_session(self, namespace: str, session: str) -> int:
        """Drop one tenant's session from every model's store; returns the chunks dropped. Blocking."""
        return sum(store.forget_session(namespace, session) for store in self.stores.values())

    def close(self) -> None:
        self._worker.close()
        for store in self.stores.values():
            store.close()

    def _warmup(self) -> None:
        """One short forward per model on the worker thread, so the first client does not pay for
        lazy initialisation (kernels, allocator arenas): it made a 40-token first prefill ~2 s slower."""
        for lm in self.models.values():
            with torch.inference_mode():
                ids = torch.tensor([[lm.tokenizer.eos_token_id or 0] * 8], device=lm.device)
                lm.model(
                    input_ids=ids, cache=job_cache(lm.model.config, 16), use_cache=True, logits_to_keep=1
                )

    def _start_job(self, job: Job) -> JobState:
        req = job.request
        return JobState(job, self.models[req.model], self.stores.get(req.model), self._prefill_chunk)

    def _prefetch(self, job: Job) -> None:
        req = job.request
        store = self.stores.get(req.model)
        if store is None or not req.reuse:
            return
        # Not counted: the job's own lookup, when it runs, is the hit or miss.
        match = store.lookup(req.namespace, req.prompt_ids[:-1], hint_keys=req.hint_keys, count=False)
        if match.tokens:
            store.prefetch(match)
