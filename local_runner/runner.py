"""The local runner's face to the proxy: which models it serves, prompt rendering, job submission."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier import KVStore, PrefixMatch, Schedule, StoreStats, available_memory_bytes

from .job_kv import JobKV
from .job_state import JobState
from .jobs import GenerationRequest, Job
from .loader import LoadedModel
from .packed_attention import can_pack, use_packed_attention
from .prompt import PromptError, fit_history, render_prompt
from .realign import ShiftStats
from .rope_config import rope_shift_for
from .rope_shift import RopeShift
from .step import Work, run_packed, run_per_job
from .worker import Worker

log = logging.getLogger("attnstore.runner")


@dataclass(frozen=True)
class RunnerStats:
    queued: int
    running: int
    cancelled: int  # jobs stopped because their client went away
    stores: dict[str, StoreStats]  # per served model with a KV store
    shifted_turns: int = 0  # turns that reused KV moved to new positions after a truncation
    shifted_tokens: int = 0  # the tokens so moved
    admitted: int = 0  # jobs taken from the queue so far
    queue_wait_seconds: float = 0.0  # their time in the queue, summed (mean = this / admitted)


@dataclass(frozen=True)
class RenderedPrompt:
    ids: list[int]
    dropped_messages: int  # the oldest messages truncation left out (0: the whole conversation is in)


class Runner:
    def __init__(
        self,
        models: Mapping[str, LoadedModel],
        stores: Mapping[str, KVStore] | None = None,
        *,
        max_queue: int = 16,
        max_running: int = 4,
        lookahead: int = 1,
        max_batch_tokens: int = 512,
        kv_budget_bytes: int = 0,
        max_context_tokens: int | None = None,
        truncate_on_overflow: bool = False,
        decouple: bool = False,
        batch: bool = True,
        scheduler_aware: bool = True,
        overlap_with_compute: bool = True,
        evict_on_pressure: bool = True,
        min_free_memory_bytes: int = 0,
    ):
        self.models = dict(models)
        self.stores = dict(stores or {})
        self._lookahead = lookahead
        self._scheduler_aware = scheduler_aware
        self._evict_on_pressure = evict_on_pressure
        self._min_free = min_free_memory_bytes  # 0: no memory-pressure check at admission
        self._queued_matches: dict[int, PrefixMatch] = {}  # id(job) -> its stored prefix, while queued
        self._max_context = max_context_tokens
        self._truncate = truncate_on_overflow
        # decouple: a truncated turn moves the kept turns' stored KV to its new positions, for models whose
        # RoPE allows an exact move; the others recompute after a truncation (said once, here).
        self._rope: dict[str, RopeShift] = {}
        if decouple and truncate_on_overflow:
            for name, lm in self.models.items():
                rope = rope_shift_for(lm.model)
                if isinstance(rope, RopeShift):
                    self._rope[name] = rope
                else:
                    log.info("model %s: truncated turns recompute (no position shift): %s", name, rope)
        self.shift_stats = ShiftStats()
        # batch=False: one forward per job per step for every model (a benchmark's same-run baseline).
        self._packed = {name: batch and self._choose_step(lm) for name, lm in self.models.items()}
        self._worker = Worker(
            self._start_job,
            self._prefetch,
            max_queue=max_queue,
            max_running=max_running,
            lookahead=lookahead,
            max_batch_tokens=max_batch_tokens,
            kv_budget_bytes=kv_budget_bytes,
            job_bytes=self._job_bytes,
            packed=lambda state: self._packed[state.job.request.model],
            warmup=self._warmup,
            on_queue_change=self._publish_schedule if scheduler_aware and self.stores else None,
            admission_error=self._memory_refusal,
            overlap=overlap_with_compute,
            on_oom=self._free_device_memory,
        )

    @staticmethod
    def _choose_step(lm: LoadedModel) -> bool:
        """Llama-style decoders take the packed (batched) step; any other model runs one job per forward."""
        reason = can_pack(lm.model.config)
        if reason is None:
            use_packed_attention(lm.model)
            return True
        log.info("model %s: one forward per job (no batched steps): %s", lm.name, reason)
        return False

    def serves(self, model: str) -> bool:
        return model in self.models

    def context_limit(self, model: str) -> int:
        """Prompt + answer tokens a job may hold: the model's context, or less where settings say so."""
        limit = self.models[model].max_context
        return min(limit, self._max_context) if self._max_context else limit

    def render(self, model: str, messages: Sequence[dict[str, Any]], reserve: int = 1) -> list[int]:
        """Prompt token ids, leaving `reserve` tokens of the context for the answer (see render_turn)."""
        return self.render_turn(model, messages, reserve).ids

    def render_turn(self, model: str, messages: Sequence[dict[str, Any]], reserve: int = 1) -> RenderedPrompt:
        """The prompt, leaving `reserve` tokens of the context for the answer.

        A conversation that has outgrown the context loses its oldest whole turns (system messages and
        the last message stay) when truncate_on_overflow is set, cut with headroom where its later turns
        cut too (prompt.fit_history); otherwise it is refused with PromptError, as is content the
        runner cannot serve."""
        tokenizer = self.models[model].tokenizers.get()
        limit = self.context_limit(model)
        reserve = max(1, min(reserve, limit // 4))
        if self._truncate:
            ids, dropped = fit_history(tokenizer, messages, limit, reserve)
        else:
            ids, dropped = render_prompt(tokenizer, messages), 0
        if len(ids) + reserve > limit:
            raise PromptError(
                f"the prompt has {len(ids)} tokens; {model} takes at most {limit - reserve} here",
                "messages",
                code="context_length_exceeded",
            )
        return RenderedPrompt(ids, dropped)

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
            shifted_turns=self.shift_stats.turns,
            shifted_tokens=self.shift_stats.tokens,
            admitted=self._worker.admitted,
            queue_wait_seconds=self._worker.queue_wait_seconds,
        )

    def describe(self) -> dict[str, dict[str, object]]:
        """Per served model: where and how it runs (for /healthz)."""
        return {
            name: {
                "device": str(lm.device),
                "dtype": str(lm.dtype).removeprefix("torch."),
                "batched": self._packed[name],
            }
            for name, lm in self.models.items()
        }

    def reusable_tokens(self, request: GenerationRequest) -> int:
        """Prompt tokens of this request whose KV is stored now (a look, not counted as a hit or miss).
        Blocking (the store's lock, perhaps a file header): call it off the event loop."""
        store = self.stores.get(request.model)
        if store is None or not request.reuse:
            return 0
        ids = request.prompt_ids[:-1]
        return store.lookup(request.namespace, ids, hint_keys=request.hint_keys, count=False).tokens

    def forget_session(self, namespace: str, session: str) -> int:
        """Drop one tenant's session from every model's store; returns the chunks dropped. Blocking."""
        return sum(store.forget_session(namespace, session) for store in self.stores.values())

    def close(self) -> None:
        self._worker.close()
        for store in self.stores.values():
            store.close()

    def _warmup(self) -> None:
        """One short step per model on the worker thread, so the first client does not pay for lazy
        initialisation (kernels, allocator arenas): it made a 40-token first prefill ~2 s slower."""
        for name, lm in self.models.items():
            kv = JobKV(lm.layout, lm.device, 16)
            run = run_packed if self._packed[name] else run_per_job
            run(lm, [Work(kv, [lm.tokenizer.eos_token_id or 0] * 8, want_logits=True)])
            run(lm, [Work(kv, [lm.tokenizer.eos_token_id or 0], want_logits=True)])

    def _job_bytes(self, job: Job) -> int:
        req = job.request
        return (len(req.prompt_ids) + req.sampling.max_tokens) * self.models[req.model].layout.bytes_per_token

    def _start_job(self, job: Job) -> JobState:
        req = job.request
        return JobState(
            job,
            self.models[req.model],
            self.stores.get(req.model),
            rope=self._rope.get(req.model),
            shift_stats=self.shift_stats,
        )

    def _queued_match(self, job: Job) -> PrefixMatch | None:
        """A queued job's stored prefix, looked up once (not counted: its own lookup, when it runs, is
        the hit or miss)."""
        req = job.request
        store = self.stores.get(req.model)
        if store is None or not req.reuse:
            return None
        match = self._queued_matches.get(id(job))
        if match is None:
            match = store.lookup(req.namespace, req.prompt_ids[:-1], hint_keys=req.hint_keys, count=False)
            self._queued_matches[id(job)] = match
        return match

    def _prefetch(self, job: Job) -> None:
        match = self._queued_match(job)
        if match is not None and match.tokens:
            self.stores[job.request.model].prefetch(match)

    def _publish_schedule(self, prefilling: list[JobState], pending: list[Job]) -> None:
        """The queue as each model's store sees it: chunks of jobs still restoring or prefilling and of
        the look-ahead window are protected; other queued jobs' chunks go from the back of the queue."""
        waiting = {id(j) for j in pending}
        self._queued_matches = {k: m for k, m in self._queued_matches.items() if k in waiting}
        for name, store in self.stores.items():
            running = [
                [c.key for c in s.match.chunks]
                for s in prefilling
                if s.match is not None and s.job.request.model == name
            ]
            queue = []
            for job in pending:
                match = self._queued_match(job) if job.request.model == name else None
                queue.append([c.key for c in match.chunks] if match is not None else [])
            store.set_schedule(Schedule.from_queue(running, queue, self._lookahead))

    def _memory_refusal(self, job: Job) -> str | None:
        """Before a job's buffers are allocated: is the machine short of memory (below the configured
        free memory, whatever the tier capacities say)? With evict_on_pressure the stores drop memory
        copies of chunks that are safe on disk and the job runs; without, it is refused (503)."""
        if not self._min_free:
            return None
        available = available_memory_bytes()
        if available is None:
            return None
        short = self._min_free + self._job_bytes(job) - available
        if short <= 0:
            return None
        mb = 1024 * 1024
        if self._evict_on_pressure:
            freed = sum(store.shed_memory(short) for store in self.stores.values())
            log.warning(
                "memory pressure: %d MB available, %d MB to keep free; dropped %d MB of stored KV from memory",
                available // mb,
                self._min_free // mb,
                freed // mb,
            )
            return None
        return (
            f"the local runner is short of memory ({available // mb} MB available, "
            f"{self._min_free // mb} MB kept free); retry later"
        )

    def _free_device_memory(self) -> bool:
        """A CUDA out-of-memory in a step: with evict_on_pressure, demote L0 (the device tier) and let
        the step run again; without, the job fails (503)."""
        if not self._evict_on_pressure:
            return False
        freed = sum(store.shed_device_memory() for store in self.stores.values())
        log.warning("device out of memory: moved %d MB of stored KV off the device", freed // (1024 * 1024))
        return freed > 0
