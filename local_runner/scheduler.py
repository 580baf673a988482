"""The scheduler: who waits, who runs, and what each step feeds (nano-vllm's `Scheduler`, for this runner).

It owns the waiting jobs (admission.py: per-client queues, round-robin), the running jobs' states and
the KV pages they hold, and it plans each step:

- `admit()`: the next jobs in the rotation that fit (pages of their model's pool for the whole prompt,
  `max_running`, and the KV budget), each with those pages; the worker starts them (lookup, restore).
  A job preempted earlier comes back first.
- `plan()`: one step's work: one decode token for every decoding job, then prompt chunks of prefilling
  jobs under `max_batch_tokens` (chunked prefill). A job whose restore is still reading stays out
  (a step never waits on a disk) unless nothing else can run. With `batch_invariant`, a prompt's
  chunks are cut where the job alone would cut them (its own fixed chunk size, not what is left of a
  shared budget), so its KV and logits do not depend on the company it keeps.
- `ended()`: jobs that ended in the last step (they leave `running`); the worker hands them to the
  save hand-off, and `release()` gives their pages back once it is over.
- When a decoding job needs a page and the pool has none (a device pool, sized from memory), the
  youngest other running job is preempted: its pages go back and it waits at the head of the queue
  (job_state.JobState.preempt). A job that cannot grow with nothing left to preempt fails (503).

Thread safety: `submit` and `drop_waiting` come from the event loop's threads, the stats readers
(`counts`, `queue_depth`, `running_count`) from any thread; everything else runs on the worker's
thread. One condition variable (`cond`) guards the queue and the counters, and wakes the worker; the
counters are written by this class only (`end_cancelled` counts the running jobs the worker ends).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from engine_api.errors import QueueFull
from engine_api.turn import Failed, Finished

from .admission import AdmissionQueue
from .config import EngineConfig
from .job_kv import JobKV
from .job_state import JobState, Status
from .jobs import Job
from .kv_pages import PagePool, PoolExhausted
from .step import Work

# The least a step gives prefill when decoding jobs use up the budget, so a new turn always advances.
MIN_PREFILL_TOKENS = 32


@dataclass(frozen=True)
class SchedulerCounts:
    """The scheduler's counters, read together under its lock (for the stats endpoint)."""

    queued: int
    waiting_clients: int
    admitted: int
    queue_wait_seconds: float
    cancelled: int


class Scheduler:
    def __init__(self, config: EngineConfig, pools: Mapping[str, PagePool], *, batch_invariant: bool):
        self.config = config
        self.pools = dict(pools)
        # Prompt chunks cut where a job alone would cut them (a step of any model is invariant); the
        # config's batch_invariant may be "auto": each model step resolves it.
        self.batch_invariant = batch_invariant
        # A prompt chunk's size with batch_invariant: the same whatever else runs.
        self.invariant_chunk = max(MIN_PREFILL_TOKENS, config.max_batch_tokens - config.max_running)
        # Shared state, all of it owned (written) by this scheduler only. `cond` guards the queue,
        # `starting`, `stopping` and the counters below (event-loop threads submit and cancel; the worker
        # admits); `running` is changed under `cond` on the worker's thread only, which alone reads it
        # unlocked (other threads read it through `running_count`).
        self.cond = threading.Condition()
        self.queue = AdmissionQueue(config.max_queue, config.max_running)  # guarded by `cond`
        self.running: list[JobState] = []
        self.preempted: list[JobState] = []  # worker's thread only: waiting to run again, oldest first
        self.starting = 0  # taken from the queue by admit(), not yet in `running`
        self.stopping = False
        self.admitted = 0  # jobs taken from the queue so far
        self.queue_wait_seconds = 0.0  # their time in the queue, summed
        self.cancelled = 0  # jobs stopped because their client went away
        self.preemptions = 0  # jobs that gave their pages back for another's next token (worker's thread)

    # -- event loop side ------------------------------------------------------------------------------

    def submit(self, job: Job, *, hit: bool = False) -> None:
        """Queue a job (QueueFull: 503 or upstream; OverShare: 429). A job it displaces ends at once:
        with 429 (its client was over its share), or as `queue_full` (a miss the upstream takes)."""
        with self.cond:
            if self.stopping:
                raise QueueFull("the local runner is shutting down")
            displaced = self.queue.submit(
                job, len(self.running) + self.starting, self.retry_after_s(), hit=hit
            )
            self.cond.notify_all()
        if displaced is not None and displaced.reason == "overflow":
            displaced.job.emit(
                Failed("a hit took this miss's place in the full local queue", status=503, code="queue_full")
            )
        elif displaced is not None:
            displaced.job.emit(
                Failed(
                    "another client needed this request's place in the local queue (this client holds more "
                    "than its share); retry later",
                    status=429,
                    code="rate_limit_exceeded",
                    retry_after_s=self.retry_after_s(),
                )
            )

    def drop_waiting(self, job: Job) -> None:
        """Its client went away (Job.cancel): a waiting job leaves the queue now (its place, its
        look-ahead window place and prefetch protection go with it); a running one ends at the next
        step."""
        with self.cond:
            removed = self.queue.remove(job)
            if removed:
                self.cancelled += 1
                self.cond.notify_all()
        if removed:  # it ends now, as a cancelled running job does (nobody may be listening any more)
            job.emit(Finished("cancelled", len(job.request.prompt_ids), 0, 0))

    def retry_after_s(self) -> float:
        """What a refused client is told to wait: the mean queue wait so far (at least 1 s)."""
        with self.cond:  # reentrant: submit() asks while it holds the lock
            return max(1.0, self.queue_wait_seconds / self.admitted) if self.admitted else 1.0

    # -- any thread (stats) ---------------------------------------------------------------------------

    def queue_depth(self) -> int:
        with self.cond:
            return len(self.queue)

    def running_count(self) -> int:
        """Jobs computing now (not those whose save hand-off is still under way)."""
        with self.cond:
            return sum(1 for s in self.running if s.computing)

    def counts(self) -> SchedulerCounts:
        with self.cond:
            return SchedulerCounts(
                queued=len(self.queue),
                waiting_clients=self.queue.clients(),
                admitted=self.admitted,
                queue_wait_seconds=self.queue_wait_seconds,
                cancelled=self.cancelled,
            )

    # -- worker side ----------------------------------------------------------------------------------

    def wait_for_work(self) -> bool:
        """Block until there is something to do; False once the runner stops."""
        with self.cond:
            while not self.stopping and not len(self.queue) and not self.running and not self.preempted:
                self.cond.wait()
            return not self.stopping

    def resume_preempted(self) -> list[JobState]:
        """Preempted jobs that fit again (pages for everything they will feed), oldest first; they are
        running again when this returns."""
        resumed: list[JobState] = []
        computing = sum(1 for s in self.running if s.computing)
        while self.preempted and computing < self.config.max_running:
            state = self.preempted[0]
            try:
                state.kv.ensure(len(state.feed) + 1)
            except PoolExhausted:
                break
            self.preempted.pop(0)
            with self.cond:
                self.running.append(state)
            resumed.append(state)
            computing += 1
        return resumed

    def admit(self) -> list[tuple[Job, JobKV]]:
        """The next waiting jobs that fit, each with the pages it now holds for its prompt (round-robin
        between clients). A job that does not fit (no pages for its prompt, `max_running`, or past the KV
        budget while others run) waits, and so does everything behind it: admission order is the
        fairness. Preempted jobs run again first."""
        taken: list[tuple[Job, JobKV]] = []
        if self.preempted:
            return taken
        reserved = sum(s.job.kv_bytes for s in self.running if s.computing)
        computing = sum(1 for s in self.running if s.computing)
        with self.cond:
            while len(self.queue) and computing + len(taken) < self.config.max_running:
                job = self.queue.peek()
                assert job is not None
                need = job.kv_bytes
                budget = self.config.kv_budget_bytes
                if budget and (computing or taken) and reserved + need > budget:
                    break
                kv = JobKV(self.pools[job.request.model])
                try:
                    kv.ensure(len(job.request.prompt_ids) + 1)
                except PoolExhausted:
                    break  # its model's pages are all held (some by jobs still saving)
                self.queue.pop()
                taken.append((job, kv))
                reserved += need
            self.starting = len(taken)
            now = time.monotonic()
            for job, _ in taken:
                self.admitted += 1
                self.queue_wait_seconds += now - job.submitted_at
        return taken

    def started(self, state: JobState | None) -> None:
        """An admitted job is running (or could not start: None)."""
        with self.cond:
            self.starting = max(0, self.starting - 1)
            if state is not None:
                self.running.append(state)

    def window(self) -> list[Job]:
        """The waiting jobs in admission order (the look-ahead window is its head)."""
        with self.cond:
            return list(self.queue.in_order())

    def plan(self) -> list[tuple[JobState, Work]]:
        live = [s for s in self.running if s.computing]
        for s in live:
            s.settle_restore()
        ready = [s for s in live if s.status is not Status.RESTORING]
        if not ready and live:
            if not self.config.overlap_with_compute:
                live[0].wait_restore(0.05)  # nothing else to run: wait for its restore, not for long
                return []
            ready = live[:1]  # nothing else to run: this one computes while its layers load
        plan: list[tuple[JobState, Work]] = []
        decoding = [s for s in ready if not s.prefilling and self._grow(s)]
        decoding = [s for s in decoding if s.computing and not s.prefilling]  # none preempted meanwhile
        for s in decoding:
            plan.append((s, Work(s.kv, s.next_tokens(1), want_logits=True)))
        budget = max(self.config.max_batch_tokens - len(decoding), MIN_PREFILL_TOKENS)
        for s in ready:
            if budget <= 0:
                break
            if s.prefilling and s.computing and s.kv.pages:  # not preempted (nor failed) just now
                want = self.invariant_chunk if self.batch_invariant else budget
                tokens = s.next_tokens(want)
                done = len(s.fed_ids) + len(tokens) >= len(s.feed)
                plan.append((s, Work(s.kv, tokens, want_logits=done)))
                budget -= len(tokens)
        return plan

    def _grow(self, state: JobState) -> bool:
        """A page for a decoding job's next token, preempting the youngest other running job while the
        pool has none. False: the job did not get one (it ended, or it was preempted itself)."""
        while True:
            try:
                state.kv.ensure(state.kv.length + 1)
                return True
            except PoolExhausted:
                victim = next(
                    (
                        s
                        for s in reversed(self.running)
                        if s is not state and s.computing and not s.restore_pending and s.kv.pages
                    ),
                    None,
                )
                if victim is None:
                    state.fail(
                        MemoryError("the KV pool has no room for this answer's next token"),
                        status=503,
                        code="memory_pressure",
                    )
                    return False
                self._preempt(victim)

    def _preempt(self, state: JobState) -> None:
        self.preemptions += 1
        state.preempt()
        with self.cond:
            self.running.remove(state)
        self.preempted.append(state)

    def end_cancelled(self) -> None:
        """Running jobs whose client went away end now (and are counted, under the lock)."""
        for state in [s for s in self.running if s.computing and s.job.cancelled]:
            state.finish("cancelled")
            with self.cond:
                self.cancelled += 1

    def ended(self) -> list[JobState]:
        """Jobs that ended in the last step (their save hand-off is next); they leave `running`."""
        with self.cond:
            done = [s for s in self.running if s.status is Status.SAVING]
            self.running = [s for s in self.running if s.status is not Status.SAVING]
            return done

    def release(self, state: JobState) -> None:
        """The save hand-off is over: the pages go back to the pool and the worker may admit again."""
        state.kv.release()
        with self.cond:
            self.cond.notify_all()

    def stop(self) -> list[Job]:
        """No more work: every job not ended (waiting or running) is returned to be failed."""
        with self.cond:
            self.stopping = True
            jobs = [s.job for s in self.running if s.computing] + [s.job for s in self.preempted]
            jobs += self.queue.drain()
            self.preempted = []
            self.cond.notify_all()
            return jobs


__all__ = ["Scheduler", "SchedulerCounts"]
