"""The local runner's face to the proxy: which models it serves, prompt rendering, job submission."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier import KVStore, PrefixMatch, Schedule, StoreStats, available_memory_bytes

from .config import RunnerConfig
from .job_state import JobState, Status
from .jobs import GenerationRequest, Job
from .kv_slots import SlotPool
from .loader import LoadedModel
from .model_step import ModelStep
from .prompt import fit_turn
from .realign import ShiftStats
from .rope_config import rope_shift_for
from .rope_shift import RopeShift
from .scheduler import Scheduler, SchedulerConfig
from .step import Work
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
    waiting_clients: int = 0  # clients with jobs in the queue (admission alternates between them)
    forked_tokens: int = 0  # n > 1: prompt tokens copied from the first answer's KV, not computed


@dataclass(frozen=True)
class RenderedPrompt:
    ids: list[int]
    dropped_messages: int  # the oldest messages truncation left out (0: the whole conversation is in)


class Runner:
    """Implements the worker's hooks (worker.RunnerHooks): starting jobs, the stores' view of the queue,
    memory pressure, and the forward itself."""

    def __init__(
        self,
        models: Mapping[str, LoadedModel],
        stores: Mapping[str, KVStore] | None = None,
        config: RunnerConfig | None = None,
        **options: Any,
    ):
        """Every option in `config` (RunnerConfig's defaults without one). Keyword options instead of a
        config are a stop-gap for callers not yet moved to RunnerConfig (tests/test_compiled_step.py)."""
        if options:
            if config is not None:
                raise TypeError("Runner takes a RunnerConfig or keyword options, not both")
            config = RunnerConfig(**options)
        self.config = config = config or RunnerConfig()
        self.models = dict(models)
        self.stores = dict(stores or {})
        self._lookahead = config.lookahead
        self._scheduler_aware = config.scheduler_aware
        self._evict_on_pressure = config.evict_on_pressure
        self._min_free = config.min_free_memory_bytes  # 0: no memory-pressure check at admission
        self._queued_matches: dict[int, PrefixMatch] = {}  # id(job) -> its stored prefix, while queued
        self._max_context = config.max_context_tokens
        self._truncate = config.truncate_on_overflow
        self.batch_invariant = config.batch_invariant
        # decouple: a truncated turn moves the kept turns' stored KV to its new positions, for models whose
        # RoPE allows an exact move; the others recompute after a truncation (said once, here).
        self._rope: dict[str, RopeShift] = {}
        if config.decouple and config.truncate_on_overflow:
            for name, lm in self.models.items():
                rope = rope_shift_for(lm.model)
                if isinstance(rope, RopeShift):
                    self._rope[name] = rope
                else:
                    log.info("model %s: truncated turns recompute (no position shift): %s", name, rope)
        self.shift_stats = ShiftStats()
        # Prompt tokens of n > 1 answers copied from their first answer's slot, not computed (owned by
        # the runner, written by the worker's thread only, read unlocked by `stats()`; so is shift_stats).
        self.forked_tokens = 0
        self.steps = {
            name: ModelStep.prepare(
                lm,
                slots=config.max_running,
                context=self._context_cap(lm),
                batch=config.batch,
                batch_invariant=config.batch_invariant,
                compile=config.compile,
                max_rows=config.max_batch_tokens + config.max_running,
            )
            for name, lm in self.models.items()
        }
        self.pools = {name: step.pool for name, step in self.steps.items()}
        scheduling = SchedulerConfig(
            max_queue=config.max_queue,
            max_running=config.max_running,
            lookahead=config.lookahead,
            max_batch_tokens=max(1, config.max_batch_tokens),
            kv_budget_bytes=config.kv_budget_bytes,
            overlap=config.overlap_with_compute,
            batch_invariant=config.batch_invariant,
        )
        self.scheduler = Scheduler(scheduling, self.pools, self._job_bytes)
        self._worker = Worker(self.scheduler, self)
        self._worker.start()  # last: the worker's thread sees a runner whose every field is set

    def _context_cap(self, lm: LoadedModel) -> int:
        limit = lm.max_context
        return min(limit, self._max_context) if self._max_context else limit

    def serves(self, model: str) -> bool:
        return model in self.models

    def context_limit(self, model: str) -> int:
        """Prompt + answer tokens a job may hold: the model's context, or less where settings (or, on
        CUDA, the device memory for its KV slots) say so."""
        return self.pools[model].capacity

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
        ids, dropped = fit_turn(
            tokenizer, messages, model=model, limit=limit, reserve=reserve, truncate=self._truncate
        )
        return RenderedPrompt(ids, dropped)

    def submit(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None, *, hit: bool = False
    ) -> Job:
        """Queue a job in its client's queue (admission.py: QueueFull when nothing can take it, OverShare
        past the client's share while others wait). `hit`: its KV is stored here; at a full queue it may
        take the place of a waiting miss the upstream can serve. max_tokens is capped so that prompt +
        answer fit the model's context."""
        room = self.context_limit(request.model) - len(request.prompt_ids)
        request.sampling.max_tokens = max(1, min(request.sampling.max_tokens, room))
        job = Job(request, loop or asyncio.get_running_loop(), on_cancel=self.scheduler.drop_waiting)
        job.outbox = self._worker.outbox
        self.scheduler.submit(job, hit=hit)
        return job

    @property
    def queue_depth(self) -> int:
        return len(self.scheduler.queue)

    @property
    def running(self) -> int:
        return sum(1 for s in self.scheduler.running if s.computing)

    @property
    def cancelled(self) -> int:
        return self.scheduler.cancelled

    def waiting_jobs(self) -> list[Job]:
        """The waiting jobs in the order they will be admitted (round-robin between clients)."""
        return self.scheduler.window()

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
            admitted=self.scheduler.admitted,
            queue_wait_seconds=self.scheduler.queue_wait_seconds,
            waiting_clients=self.scheduler.queue.clients(),
            forked_tokens=self.forked_tokens,
        )

    def describe(self) -> dict[str, dict[str, object]]:
        """Per served model: where and how it runs (for /healthz)."""
        return {name: step.describe() for name, step in self.steps.items()}

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
        for pool in self.pools.values():
            pool.close()

    # -- the worker's hooks (worker.RunnerHooks) ------------------------------------------------------

    def warmup(self) -> None:
        """Per model, on the worker thread: compile the packed step where wanted, then run each kind of
        step once (ModelStep.warm_up), so the first client pays for neither."""
        for name, step in self.steps.items():
            step.warm_up(functools.partial(self._forward, name))

    def run(self, items: list[tuple[JobState, Work]]) -> list[torch.Tensor | None]:
        """One forward over the step's work (every item is of one model)."""
        return self._forward(items[0][0].job.request.model, [w for _, w in items])

    def _forward(self, model: str, work: list[Work]) -> list[torch.Tensor | None]:
        return self.steps[model].forward(work)

    def packed(self, state: JobState) -> bool:
        return self.steps[state.job.request.model].packed

    def _job_bytes(self, job: Job) -> int:
        req = job.request
        return (len(req.prompt_ids) + req.sampling.max_tokens) * self.models[req.model].layout.bytes_per_token

    def start_job(self, job: Job, pool: SlotPool, slot: int) -> JobState:
        req = job.request
        source = self._fork_source(req, pool)
        if source is not None:
            self.forked_tokens += len(req.prompt_ids) - 1
        return JobState(
            job,
            self.models[req.model],
            self.stores.get(req.model),
            pool,
            slot,
            rope=self._rope.get(req.model),
            shift_stats=self.shift_stats,
            fork_source=source,
        )

    def _fork_source(self, req: GenerationRequest, pool: SlotPool) -> JobState | None:
        """n > 1: the running job of the prompt this one shares, once its prompt is in its slot (it is
        decoding); None when there is none (it ended already): then this one looks the prompt up."""
        if req.fork_of is None:
            return None
        for state in self.scheduler.running:
            if state.job.request is req.fork_of and state.pool is pool and state.status is Status.DECODING:
                return state
        return None

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

    def prefetch(self, job: Job) -> None:
        match = self._queued_match(job)
        if match is not None and match.tokens:
            self.stores[job.request.model].prefetch(match)

    def publish_queue(self, prefilling: list[JobState], pending: list[Job]) -> None:
        """The queue as each model's store sees it: chunks of jobs still restoring or prefilling and of
        the look-ahead window are protected; other queued jobs' chunks go from the back of the queue."""
        if not (self._scheduler_aware and self.stores):
            return
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

    def admission_error(self, job: Job) -> str | None:
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
            for pool in self.pools.values():
                pool.give_back()  # pages of free KV slots, first (what they held is gone already)
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

    def free_device_memory(self) -> bool:
        """A CUDA out-of-memory in a step: with evict_on_pressure, demote L0 (the device tier) and let
        the step run again; without, the job fails (503)."""
        if not self._evict_on_pressure:
            return False
        freed = sum(store.shed_device_memory() for store in self.stores.values())
        log.warning("device out of memory: moved %d MB of stored KV off the device", freed // (1024 * 1024))
        return freed > 0
