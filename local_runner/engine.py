"""The embedded engine: the model steps, the KV pools, the stores, the scheduler and the worker loop,
configured by one `RunnerConfig` and started explicitly (nano-vllm's `LLMEngine`).

`runner.Runner` is the proxy's thin facade over it (rendering, submission, stats); this class is what
runs a turn. The loop itself (schedule -> run -> postprocess) is `worker.Worker`'s; the engine gives it
everything that needs the models or the stores through the worker's hooks (`worker.EngineHooks`):
starting a job, the stores' view of the queue, memory pressure and the forward.

Ownership (who writes what; everything else only reads):
- the engine: `steps`, `pools`, `stores`, `scheduler`, the worker, `counters` and `_rope`, all made in
  the constructor and never replaced, so any thread may read them (each guards what changes inside);
- the hooks, on the worker's thread only: `_queued_matches`;
- the scheduler: the queue, the running jobs and their counters (see scheduler.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Mapping

import torch

from kvtier import KVStore, PrefixMatch, Schedule, available_memory_bytes

from .config import RunnerConfig
from .job_kv import JobKV
from .job_state import JobState, Status
from .jobs import GenerationRequest, Job
from .kv_pages import DEFAULT_PAGE_TOKENS
from .loader import LoadedModel
from .model_step import ModelStep
from .realign import ShiftStats
from .reuse_policy import restore_prefix
from .rope_config import rope_shift_for
from .rope_shift import RopeShift
from .scheduler import Scheduler, SchedulerConfig
from .step import Work
from .worker import Worker

log = logging.getLogger("attnstore.runner")


class EngineCounters:
    """What the engine counts for the stats endpoint beyond the scheduler's own counters. Owned by the
    engine, written on its worker's thread, read from any thread; each counter behind its own lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._forked_tokens = 0
        # Turns that reused KV moved to new positions after a truncation, and the tokens moved (counted
        # by the jobs themselves, at their first token).
        self.shift_stats = ShiftStats()

    def forked(self, tokens: int) -> None:
        """n > 1: prompt tokens copied from the first answer's slot, not computed."""
        with self._lock:
            self._forked_tokens += tokens

    @property
    def forked_tokens(self) -> int:
        with self._lock:
            return self._forked_tokens


class Engine:
    """Owns the steps, pools, stores, scheduler and the worker; implements the worker's hooks.

    Built in two steps so that the worker's thread never sees a half-made engine: the constructor makes
    everything, `start()` starts the loop (its warm-up runs on that thread). `stop()` ends the loop and
    fails the jobs it had; `close()` also closes the stores and frees the pools."""

    def __init__(
        self,
        models: Mapping[str, LoadedModel],
        stores: Mapping[str, KVStore] | None = None,
        config: RunnerConfig | None = None,
    ) -> None:
        self.config = config = config or RunnerConfig()
        self.models = dict(models)
        self.stores = dict(stores or {})
        self._queued_matches: dict[int, PrefixMatch] = {}  # id(job) -> its stored prefix, while queued
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
        self.counters = EngineCounters()
        self.steps = {
            name: ModelStep.prepare(
                lm,
                slots=config.max_running,
                context=self._context_cap(lm),
                page_tokens=self._page_tokens(name),
                device_reserve_bytes=config.device_reserve_bytes,
                batch=config.batch,
                batch_invariant=config.batch_invariant,
                compile=config.compile,
                max_rows=config.max_batch_tokens + config.max_running,
            )
            for name, lm in self.models.items()
        }
        self.pools = {name: step.pool for name, step in self.steps.items()}
        invariant = any(step.batch_invariant for step in self.steps.values())
        scheduling = SchedulerConfig(
            max_queue=config.max_queue,
            max_running=config.max_running,
            lookahead=config.lookahead,
            max_batch_tokens=max(1, config.max_batch_tokens),
            kv_budget_bytes=config.kv_budget_bytes,
            overlap=config.overlap_with_compute,
            batch_invariant=invariant,  # prompt chunks cut where a job alone would cut them
        )
        self.scheduler = Scheduler(scheduling, self.pools, self._job_bytes)
        self._worker = Worker(self.scheduler, self)

    def _page_tokens(self, model: str) -> int:
        """A page of the model's KV pool holds one chunk of its store (a restore or a save then moves
        whole pages); without a store, DEFAULT_PAGE_TOKENS."""
        store = self.stores.get(model)
        return store.config.chunk_tokens if store is not None else DEFAULT_PAGE_TOKENS

    def _context_cap(self, lm: LoadedModel) -> int:
        limit = lm.max_context
        cap = self.config.max_context_tokens
        return min(limit, cap) if cap else limit

    # -- life -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker's thread (once): it warms every step up, then serves the queue."""
        self._worker.start()

    def stop(self) -> None:
        """End the loop: jobs not ended fail, pending saves finish. The stores and pools stay open."""
        self._worker.close()

    def close(self) -> None:
        self.stop()
        for store in self.stores.values():
            store.close()
        for pool in self.pools.values():
            pool.close()

    # -- what the facade asks -------------------------------------------------------------------------

    def context_limit(self, model: str) -> int:
        """Prompt + answer tokens a job may hold: the model's context, or less where the config (or, on
        CUDA, the device memory for its KV pool) says so."""
        return min(self._context_cap(self.models[model]), self.pools[model].capacity)

    def submit(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, *, hit: bool = False
    ) -> Job:
        """Queue a job in its client's queue (the scheduler's QueueFull / OverShare). Its answer is capped
        so that prompt + answer fit the model's context (`Job.max_tokens`; the request is not changed:
        it is its caller's)."""
        room = self.context_limit(request.model) - len(request.prompt_ids)
        job = Job(
            request,
            loop,
            max_tokens=max(1, min(request.sampling.max_tokens, room)),
            on_cancel=self.scheduler.drop_waiting,
            outbox=self._worker.outbox,
        )
        self.scheduler.submit(job, hit=hit)
        return job

    @property
    def running(self) -> int:
        """Jobs computing now (not those whose save hand-off is still under way)."""
        return self.scheduler.running_count()

    # -- the worker's hooks (worker.EngineHooks), on the worker's thread ------------------------------

    def warmup(self) -> None:
        """Per model: compile the packed step where wanted, then run each kind of step once
        (ModelStep.warm_up), so the first client pays for neither."""
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
        return (len(req.prompt_ids) + job.max_tokens) * self.models[req.model].layout.bytes_per_token

    def start_job(self, job: Job, kv: JobKV) -> JobState:
        req = job.request
        source = self._fork_source(req, kv)
        if source is not None:
            self.counters.forked(len(req.prompt_ids) - 1)
        return JobState(
            job,
            self.models[req.model],
            self.stores.get(req.model),
            kv,
            rope=self._rope.get(req.model),
            shift_stats=self.counters.shift_stats,
            fork_source=source,
            restore_plan=functools.partial(self._restore_plan, req.model),
        )

    def _restore_plan(self, model: str, match: PrefixMatch) -> PrefixMatch:
        """The part of a stored prefix worth restoring (reuse_policy.py): what its tiers' measured
        bandwidth loads faster than this model's measured prefill recomputes."""
        store = self.stores[model]
        return restore_prefix(
            match,
            store.load_rates(),
            self.models[model].layout.bytes_per_token,
            self.steps[model].prefill_rate.per_token,
        )

    def _fork_source(self, req: GenerationRequest, kv: JobKV) -> JobState | None:
        """n > 1: the running job of the prompt this one shares, once its prompt is in its pages (it is
        decoding); None when there is none (it ended already): then this one looks the prompt up."""
        if req.fork_of is None:
            return None
        for state in self.scheduler.running:
            if state.job.request is req.fork_of and state.pool is kv.pool and state.status is Status.DECODING:
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
        if not (self.config.scheduler_aware and self.stores):
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
            store.set_schedule(Schedule.from_queue(running, queue, self.config.lookahead))

    def admission_error(self, job: Job) -> str | None:
        """Before a job's buffers are allocated: is the machine short of memory (below the configured
        free memory, whatever the tier capacities say)? With evict_on_pressure the stores drop memory
        copies of chunks that are safe on disk and the job runs; without, it is refused (503)."""
        min_free = self.config.min_free_memory_bytes
        if not min_free:
            return None
        available = available_memory_bytes()
        if available is None:
            return None
        short = min_free + self._job_bytes(job) - available
        if short <= 0:
            return None
        mb = 1024 * 1024
        if self.config.evict_on_pressure:
            for pool in self.pools.values():
                pool.give_back()  # free KV pages' memory, first (what they held is gone already)
            freed = sum(store.shed_memory(short) for store in self.stores.values())
            log.warning(
                "memory pressure: %d MB available, %d MB to keep free; dropped %d MB of stored KV from memory",
                available // mb,
                min_free // mb,
                freed // mb,
            )
            return None
        return (
            f"the local runner is short of memory ({available // mb} MB available, "
            f"{min_free // mb} MB kept free); retry later"
        )

    def free_device_memory(self) -> bool:
        """A CUDA out-of-memory in a step: with evict_on_pressure, demote L0 (the device tier) and let
        the step run again; without, the job fails (503)."""
        if not self.config.evict_on_pressure:
            return False
        freed = sum(store.shed_device_memory() for store in self.stores.values())
        log.warning("device out of memory: moved %d MB of stored KV off the device", freed // (1024 * 1024))
        return freed > 0
