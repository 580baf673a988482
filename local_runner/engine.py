"""The embedded engine: the served models run in this process, one step at a time (nano-vllm's `LLMEngine`).

`EmbeddedEngine` implements the engine interface the serving layer calls (`engine_api.engine.Engine`)
and owns everything that runs a turn: each model's step (`model_step.ModelStep`, with its KV pool), the
KV stores, the scheduler and the worker thread. A turn is submitted (`run`; tests and benchmarks call
`submit` and read the `Job`'s events), and the worker thread calls `step()` while there is work:

    schedule     admit waiting jobs that fit (round-robin between clients) and start them (lookup,
                 restore into their pages); tell the stores what the queue looks like and prefetch the
                 look-ahead window (store_hints.py); plan the step (scheduler.py)
    run          one forward per model for the step's work (step_run.py): packed (every job of the model
                 in one forward, decoding jobs attending in one call per layer) or one forward per job
                 for other architectures; a forward that fails is retried, or ends its jobs only, never
                 the worker; short of memory, the stores give some back (memory_guard.py)
    postprocess  each job takes its tokens (sample, stream text, stop); jobs that ended go to the save
                 hand-off (save_handoff.py), a thread of its own, so a step never waits on a save or a
                 restore settling

Compute never runs on the event loop: `run` and `submit` only queue a job; its events reach the loop
through the outbox, one wake-up per step (jobs.py).

Ownership (who writes what; everything else only reads):
- the engine: `steps`, `pools`, `stores`, `scheduler`, `counters`, `outbox` and its helpers (`hints`,
  `handoff`, `memory`, `step_run`), all made in the constructor and never replaced, so any thread may
  read them (each guards what changes inside);
- the scheduler: the queue, the running jobs and their counters (scheduler.py);
- each job's state: its own fields (job_state.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine_api.errors import QueueFull, counts_as_hit
from engine_api.stats import EngineStats
from engine_api.turn import Event, Failed, Finished, GenerationRequest
from kvtier import KVStore, PrefixMatch

from .compiled import first_line
from .config import EngineConfig
from .grammars import Grammars
from .job_kv import JobKV
from .job_state import JobState, Status
from .jobs import Job, Outbox
from .kv_pages import DEFAULT_PAGE_TOKENS
from .loader import LoadedModel, on_model_device
from .memory_guard import MemoryGuard
from .model_step import ModelStep
from .realign import ShiftStats
from .reuse_policy import restore_prefix
from .rope_config import rope_shift_for
from .rope_shift import RopeShift
from .save_handoff import SaveHandoff
from .scheduler import Scheduler
from .step_run import Result, StepRun
from .store_hints import StoreHints

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
        """n > 1: prompt tokens copied from the first answer's pages, not computed."""
        with self._lock:
            self._forked_tokens += tokens

    @property
    def forked_tokens(self) -> int:
        with self._lock:
            return self._forked_tokens


class EmbeddedEngine:
    """Built in two steps so that the worker's thread never sees a half-made engine: the constructor
    makes everything, `start()` starts the worker (its warm-up runs on that thread). `stop()` ends the
    worker and fails the jobs it had; `close()` also closes the stores and frees the pools."""

    record_tier = "l0"  # a finished turn's KV stays in the engine's device tier

    def __init__(
        self,
        models: Mapping[str, LoadedModel],
        stores: Mapping[str, KVStore] | None = None,
        *,
        config: EngineConfig,
    ) -> None:
        self.config = config
        self.models = dict(models)
        self.stores = dict(stores or {})
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
        self.grammars = {name: Grammars(lm) for name, lm in self.models.items()}
        self.steps: dict[str, ModelStep] = {}
        for name, lm in self.models.items():
            with on_model_device(lm.device):  # the kernel choice's launches go to the model's GPU
                self.steps[name] = ModelStep.prepare(
                    lm,
                    slots=config.max_running,
                    context=self._context_cap(lm),
                    page_tokens=self._page_tokens(name),
                    device_reserve_bytes=config.device_reserve_bytes,
                    batch=config.batch,
                    batch_invariant=config.batch_invariant,
                    compile=config.compile,
                    max_rows=config.max_step_rows,
                )
        self.pools = {name: step.pool for name, step in self.steps.items()}
        # Prompt chunks cut where a job alone would cut them when any model's step is invariant.
        invariant = any(step.batch_invariant for step in self.steps.values())
        self.scheduler = Scheduler(config, self.pools, batch_invariant=invariant)
        self.memory = MemoryGuard(config, self.pools, self.stores)
        self.step_run = StepRun(self.steps, self.memory)
        self.hints = StoreHints(
            self.stores, lookahead=config.lookahead, scheduler_aware=config.scheduler_aware
        )
        self.handoff = SaveHandoff(self.scheduler)
        self.outbox = Outbox()  # the events of a step, handed to the event loop once per step
        self._worker = threading.Thread(target=self._serve, name="attnstore-runner", daemon=True)
        self.outbox.thread = self._worker

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

    def start(self) -> EmbeddedEngine:
        """Start the worker's thread (once): it warms every step up, then serves the queue."""
        self._worker.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """End the worker: jobs not ended fail, pending saves finish. The stores and pools stay open."""
        for job in self.scheduler.stop():
            job.emit(Failed("the local runner stopped"))
        if self._worker.ident is not None:  # started
            self._worker.join(timeout)
        self.handoff.close()

    def close(self) -> None:
        """The worker stops and the stores' pending L2 writes finish (a restart finds every chunk)."""
        self.stop()
        for store in self.stores.values():
            store.close()
        for pool in self.pools.values():
            pool.close()

    async def aclose(self) -> None:
        return None  # nothing held on the event loop

    def _serve(self) -> None:
        """The worker's thread: every step warmed up once, then a step while there is work."""
        for lm in self.models.values():  # one device for every model (local_runner.device)
            if lm.device.type == "cuda" and lm.device.index is not None:
                # Triton launches, and torch captures CUDA graphs, on the thread's current device, not
                # the tensors': a thread starts on GPU 0
                torch.cuda.set_device(lm.device)
                break
        for step in self.steps.values():
            try:
                step.warm_up(step.forward)
            except Exception as exc:  # a slower first request is all a failed warm-up costs
                log.warning("warm-up failed", exc_info=True)
                step.warm_up_status = f"failed: {first_line(exc)}"
        while self.scheduler.wait_for_work():
            self.step()
        self.outbox.flush()

    # -- what the serving layer asks ------------------------------------------------------------------

    def serves(self, model: str) -> bool:
        return model in self.models

    def tokenizer(self, model: str) -> PreTrainedTokenizerBase:
        return self.models[model].tokenizers.get()

    def context_limit(self, model: str) -> int:
        """Prompt + answer tokens a job may hold: the model's context, or less where the config (or, on
        CUDA, the device memory for its KV pool) says so."""
        return min(self._context_cap(self.models[model]), self.pools[model].capacity)

    def max_context_tokens(self) -> int:
        return max((self.context_limit(m) for m in self.models), default=0)

    def fingerprint(self, model: str) -> str:
        return self.models[model].fingerprint[:10]

    def load(self) -> int:
        return self.scheduler.queue_depth() + self.scheduler.running_count()

    def describe(self) -> dict[str, Any]:
        """Per served model: where and how it runs (for /healthz)."""
        return {name: step.describe() for name, step in self.steps.items()}

    def stats(self) -> EngineStats:
        """A snapshot of the queue and of every model's store; safe from any thread (the stores lock
        themselves), but it may wait on a store's lock, so call it off the event loop."""
        scheduler = self.scheduler.counts()
        shifted_turns, shifted_tokens = self.counters.shift_stats.snapshot()
        return EngineStats(
            queued=scheduler.queued,
            running=self.scheduler.running_count(),
            cancelled=scheduler.cancelled,
            stores={name: store.stats() for name, store in self.stores.items()},
            shifted_turns=shifted_turns,
            shifted_tokens=shifted_tokens,
            admitted=scheduler.admitted,
            queue_wait_seconds=scheduler.queue_wait_seconds,
            waiting_clients=scheduler.waiting_clients,
            forked_tokens=self.counters.forked_tokens,
        )

    def forget_session(self, tenant: str, session: str) -> int:
        """Drop one tenant's session from every model's store; returns the chunks dropped. Blocking."""
        return sum(store.forget_session(tenant, session) for store in self.stores.values())

    def retain(self, tenant: str, session: str, seconds: float) -> None:
        """Every model's store keeps the session for `seconds` (a session uses one model: the others
        hold none of its chunks, so the hold costs them nothing). Blocking (the stores' locks)."""
        for store in self.stores.values():
            store.retain(tenant, session, seconds)

    def reusable_tokens(self, request: GenerationRequest) -> int:
        """Prompt tokens of this request whose KV is stored now (a look, not counted as a hit or miss).
        Blocking (the store's lock, perhaps a file header): call it off the event loop."""
        store = self.stores.get(request.model)
        if store is None or not request.reuse:
            return 0
        ids = request.prompt_ids[:-1]
        return store.lookup(request.namespace, ids, hint_keys=request.hint_keys, count=False).tokens

    async def run(self, gen: GenerationRequest, *, may_overflow: bool) -> AsyncGenerator[Event, None]:
        """The turn's events (engine_api.engine.Engine.run). Its grammar is compiled for the model first.
        Cost-aware routing's look: when the upstream could serve the turn (`may_overflow`) it is looked
        up first, and a hit (counts_as_hit) that finds the queue full takes the place of a waiting miss,
        which goes upstream instead (its first event is `queue_full`, raised here as QueueFull), so hits
        stay where they are cheap."""
        if gen.sampling.grammar is not None:
            compiled = await asyncio.to_thread(self.grammars[gen.model].compile, gen.sampling.grammar)
            gen = dataclasses.replace(gen, compiled_grammar=compiled)
        hit = False
        if may_overflow:
            reusable = await asyncio.to_thread(self.reusable_tokens, gen)
            hit = counts_as_hit(reusable, len(gen.prompt_ids))
            gen = dataclasses.replace(gen, may_overflow=not hit)
        job = self.submit(gen, hit=hit)  # QueueFull / OverShare: the serving layer answers them
        try:
            async for event in job.events():
                if isinstance(event, Failed) and event.code == "queue_full":  # a hit took its place
                    raise QueueFull(event.message)
                yield event
        finally:
            if not job.done:
                job.cancel()

    def submit(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None, *, hit: bool = False
    ) -> Job:
        """Queue a job in its client's queue (admission.py: QueueFull when nothing can take it, OverShare
        past the client's share while others wait). `hit`: its KV is stored here; at a full queue it may
        take the place of a waiting miss the upstream can serve. Its answer is capped so that prompt +
        answer fit the model's context (`Job.max_tokens`; the request is not changed: it is its
        caller's). `loop`: where its events go (the running loop when not given)."""
        room = self.context_limit(request.model) - len(request.prompt_ids)
        job = Job(
            request,
            loop or asyncio.get_running_loop(),
            max_tokens=max(1, min(request.sampling.max_tokens, room)),
            bytes_per_token=self.models[request.model].layout.bytes_per_token,
            on_cancel=self.scheduler.drop_waiting,
            outbox=self.outbox,
        )
        self.scheduler.submit(job, hit=hit)
        return job

    # -- one step (the worker's thread) ---------------------------------------------------------------

    def step(self) -> None:
        """Schedule, run, postprocess; the step's events go to the event loop at its end."""
        try:
            self._schedule()
            plan = self.scheduler.plan()
            self._postprocess(self.step_run.run(plan) if plan else [])
        finally:
            self.outbox.flush()

    def _schedule(self) -> None:
        self.scheduler.resume_preempted()
        for job, kv in self.scheduler.admit():
            self.hints.admitted(job)
            self.scheduler.started(self._start(job, kv))
        self.hints.update(self.scheduler.running, self.scheduler.window())
        self.scheduler.end_cancelled()

    def _start(self, job: Job, kv: JobKV) -> JobState | None:
        """A job taken from the queue with its pages: refuse it (memory pressure), or look its prefix up
        and start its restore. A device out of memory while starting demotes L0 and retries once."""
        if job.cancelled:  # its client left while it was being admitted
            job.emit(Finished("cancelled", len(job.request.prompt_ids), 0, 0))
            kv.release()
            return None
        refusal = self.memory.refusal(job)
        if refusal is not None:
            job.emit(Failed(refusal, status=503, code="memory_pressure"))
            kv.release()
            return None
        for attempt in (1, 2):
            state = None
            try:
                state = self._job_state(job, kv)
                state.begin()
                return state
            except torch.OutOfMemoryError:
                _abandon(state)
                if attempt == 1 and self.memory.free_device_memory():
                    continue
                job.emit(
                    Failed("the device is out of memory; retry later", status=503, code="memory_pressure")
                )
            except Exception as exc:
                log.exception("could not start a job")
                _abandon(state)
                job.emit(Failed(f"could not start: {exc}"))
            break
        self.handoff.release_after_restore(kv, state)
        return None

    def _job_state(self, job: Job, kv: JobKV) -> JobState:
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

    def _postprocess(self, results: list[Result]) -> None:
        for state, fed, logits in results:
            state.advance(fed, logits)  # sample, stream text, stop (never raises: a failure ends the job)
        ended = self.scheduler.ended()
        if ended:  # their last text goes to the loop before the save hand-off can send `Finished`
            self.outbox.flush()
        for state in ended:
            self.handoff.save(state)


def _abandon(state: JobState | None) -> None:
    """A job that could not start lets go of its pins now (not when the garbage collector runs)."""
    if state is not None:
        state.release_pins()
