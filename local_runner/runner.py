"""The local runner's face to the proxy: which models it serves, prompt rendering, job submission."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier import KVStore

from .engine import JobState
from .jobs import GenerationRequest, Job
from .loader import LoadedModel
from .prompt import PromptError, render_prompt
from .worker import Worker


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
    ):
        self.models = dict(models)
        self.stores = dict(stores or {})
        self._prefill_chunk = prefill_chunk
        self._worker = Worker(
            self._start_job, self._prefetch, max_queue=max_queue, max_running=max_running, lookahead=lookahead
        )

    def serves(self, model: str) -> bool:
        return model in self.models

    def render(self, model: str, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Prompt token ids; raises PromptError for content the runner cannot serve or that is too long."""
        lm = self.models[model]
        ids = render_prompt(lm.tokenizer, messages)
        if len(ids) >= lm.max_context:
            raise PromptError(
                f"the prompt has {len(ids)} tokens; {model} takes at most {lm.max_context - 1}", "messages"
            )
        return ids

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> Job:
        """Queue a job (raises worker.QueueFull when the queue is full). max_tokens is capped so that
        prompt + answer fit the model's context."""
        lm = self.models[request.model]
        room = lm.max_context - len(request.prompt_ids)
        request.sampling.max_tokens = max(1, min(request.sampling.max_tokens, room))
        job = Job(request, loop or asyncio.get_running_loop())
        self._worker.submit(job)
        return job

    def would_queue(self) -> bool:
        return self._worker.would_queue()

    @property
    def queue_depth(self) -> int:
        return self._worker.queued

    @property
    def running(self) -> int:
        return self._worker.running

    @property
    def cancelled(self) -> int:
        return self._worker.cancelled

    def close(self) -> None:
        self._worker.close()
        for store in self.stores.values():
            store.close()

    def _start_job(self, job: Job) -> JobState:
        req = job.request
        return JobState(job, self.models[req.model], self.stores.get(req.model), self._prefill_chunk)

    def _prefetch(self, job: Job) -> None:
        req = job.request
        store = self.stores.get(req.model)
        if store is None or not req.reuse:
            return
        match = store.lookup(req.namespace, req.prompt_ids[:-1], hint_keys=req.hint_keys)
        if match.tokens:
            store.prefetch(match)
