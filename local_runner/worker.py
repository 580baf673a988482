"""The one thread that owns the models: admits jobs from a bounded queue and runs them in batched steps.

Compute never runs on the event loop. Each step is one forward over the next tokens of every running
job that is ready: one decode token per decoding job, then prompt chunks of starting jobs under a token
budget (`max_batch_tokens`), so a long new prompt and the running streams share each step (chunked
prefill) and neither starves. A job whose stored KV is still loading stays out of the step until its
restore is ready, unless nothing else can run (then it runs alone and its layers load while the model
computes the earlier ones). Jobs waiting in the queue are the scheduler's hint: their stored KV is
fetched towards the fast tiers before they run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from kvtier import KVLoadError

from .job_state import JobState
from .jobs import Failed, Finished, Job
from .step import Work, run_packed, run_per_job

log = logging.getLogger("attnstore.runner")

# The least a step gives prefill when decoding jobs use up the budget, so a new turn always advances.
MIN_PREFILL_TOKENS = 32


class QueueFull(RuntimeError):
    """The local queue is at `max_queue`: the caller answers 503 or sends the request upstream."""


class Worker:
    def __init__(
        self,
        start_job: Callable[[Job], JobState],
        prefetch: Callable[[Job], None],
        *,
        max_queue: int,
        max_running: int,
        lookahead: int,
        max_batch_tokens: int = 512,
        kv_budget_bytes: int = 0,
        job_bytes: Callable[[Job], int] = lambda job: 0,
        packed: Callable[[JobState], bool] = lambda s: True,
        warmup: Callable[[], None] | None = None,
        on_queue_change: Callable[[list[JobState], list[Job]], None] | None = None,
        admission_error: Callable[[Job], str | None] = lambda job: None,
        overlap: bool = True,
        on_oom: Callable[[], bool] = lambda: False,
    ):
        self._warmup = warmup
        self._start_job = start_job
        self._prefetch = prefetch
        self._max_queue = max_queue
        self._max_running = max_running
        self._lookahead = lookahead
        self._max_batch_tokens = max(1, max_batch_tokens)
        self._kv_budget = kv_budget_bytes  # 0: no limit beyond max_running
        self._job_bytes = job_bytes
        self._packed = packed
        self._on_queue_change = on_queue_change
        self._admission_error = admission_error
        self._overlap = overlap  # a job may compute while its layers still load (when it runs alone)
        self._on_oom = on_oom  # device out of memory: True when memory was freed (the step runs again)
        self._queue_seen: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self._pending: deque[Job] = deque()
        self._in_flight: list[Job] = []  # submitted, not ended nor cancelled (see submit)
        self._running: list[JobState] = []
        self._prefetched: set[int] = set()
        self._cond = threading.Condition()
        self._stopping = False
        self.cancelled = 0  # jobs stopped because their client went away
        self.steps = 0  # forwards run (a packed step counts once)
        self.admitted = 0  # jobs taken from the queue
        self.queue_wait_seconds = 0.0  # their time in the queue, summed
        self._thread = threading.Thread(target=self._run, name="attnstore-runner", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull when max_running + max_queue jobs are in flight already.

        In flight means submitted and not ended (nor cancelled), wherever the job is: queued, taken by the
        loop but not started yet, or running. Counting the queue and the running list instead let jobs
        through while the loop had taken the queue but not yet started its jobs, and whenever fewer
        than max_running ran (issue 13: 24 of 24 streams accepted with 4 + 4)."""
        with self._cond:
            if self._stopping:
                raise QueueFull("the local runner is shutting down")
            self._in_flight = [j for j in self._in_flight if not (j.done or j.cancelled)]
            if len(self._in_flight) >= self._max_running + self._max_queue:
                raise QueueFull(
                    f"the local runner is full ({self._max_running} running, {self._max_queue} waiting)"
                )
            self._in_flight.append(job)
            self._pending.append(job)
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    # -- the loop -------------------------------------------------------------------------------------

    def _run(self) -> None:
        if self._warmup is not None:
            try:
                self._warmup()
            except Exception:  # a slower first request is all a failed warm-up costs
                log.warning("warm-up failed", exc_info=True)
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self._running:
                    self._cond.wait()
                if self._stopping:
                    break
                admitted = self._take_admissible()
                upcoming = [
                    j for j in list(self._pending)[: self._lookahead] if id(j) not in self._prefetched
                ]
            for job in admitted:
                self._prefetched.discard(id(job))
                self._admit(job)
            self._publish_queue()
            for job in upcoming:
                self._prefetched.add(id(job))
                self._safe_prefetch(job)
            self._drop_cancelled()
            self._step()
            self._running = [s for s in self._running if not s.finished]
        self._fail_all("the local runner stopped")

    def _take_admissible(self) -> list[Job]:
        """Jobs from the head of the queue that fit: a free slot, and KV room within the budget (a job
        that does not fit waits; the first job always runs when nothing else does)."""
        taken: list[Job] = []
        reserved = sum(s.kv.nbytes_reserved for s in self._running)
        while self._pending and len(self._running) + len(taken) < self._max_running:
            need = self._job_bytes(self._pending[0])
            if self._kv_budget and (self._running or taken) and reserved + need > self._kv_budget:
                break
            taken.append(self._pending.popleft())
            reserved += need
        return taken

    def _admit(self, job: Job) -> None:
        self.admitted += 1
        self.queue_wait_seconds += time.monotonic() - job.submitted_at
        if job.cancelled:  # its client left while it waited: end it like a cancelled running job
            job.emit(Finished("cancelled", len(job.request.prompt_ids), 0, 0))
            self.cancelled += 1
            return
        refusal = self._admission_error(job)
        if refusal is not None:
            job.emit(Failed(refusal, status=503, code="memory_pressure"))
            return
        try:
            state = self._start_job(job)
            state.begin()
        except Exception as exc:
            log.exception("could not start a job")
            job.emit(Failed(f"could not start: {exc}"))
            return
        self._running.append(state)

    def _drop_cancelled(self) -> None:
        for state in self._running:
            if not state.finished and state.job.cancelled:
                state.finish("cancelled")
                self.cancelled += 1

    # -- one step -------------------------------------------------------------------------------------

    def _plan(self) -> list[tuple[JobState, Work]]:
        live = [s for s in self._running if not s.finished]
        for s in live:
            s.settle_restore()
        ready = [s for s in live if not s.restoring]
        if not ready and live:
            if not self._overlap:
                live[0].wait_restore(0.05)  # nothing else to run: wait for its restore, not for long
                return []
            ready = live[:1]  # nothing else to run: this one computes while its layers load
        plan: list[tuple[JobState, Work]] = []
        decoding = [s for s in ready if not s.prefilling]
        for s in decoding:
            plan.append((s, Work(s.kv, s.next_tokens(1), want_logits=True)))
        budget = max(self._max_batch_tokens - len(decoding), MIN_PREFILL_TOKENS)
        for s in ready:
            if budget <= 0:
                break
            if s.prefilling:
                tokens = s.next_tokens(budget)
                done = len(s.fed_ids) + len(tokens) >= len(s.job.request.prompt_ids)
                plan.append((s, Work(s.kv, tokens, want_logits=done)))
                budget -= len(tokens)
        return plan

    def _step(self) -> None:
        plan = self._plan()
        if not plan:
            return
        by_model: dict[int, list[tuple[JobState, Work]]] = {}
        for item in plan:
            by_model.setdefault(id(item[0].lm), []).append(item)
        for items in by_model.values():
            if self._packed(items[0][0]):
                self._run_packed(items)
            else:
                for item in items:
                    self._run_isolated([item], run_per_job)

    def _run_packed(self, items: list[tuple[JobState, Work]]) -> None:
        try:
            self._forward(items, run_packed)
        except torch.OutOfMemoryError:
            freed = self._on_oom()
            for item in items:
                if freed:
                    self._run_isolated([item], run_packed)
                else:
                    item[0].fail(
                        MemoryError("the device is out of memory"), status=503, code="memory_pressure"
                    )
        except KVLoadError:
            # A job running alone on a restore that failed mid-way: it recomputes; the step is redone.
            for state, _ in items:
                if state.restored is not None:
                    state.recompute(KVLoadError("restore failed"))
        except Exception as exc:
            if len(items) == 1:  # nothing to isolate: this job is the failing one
                items[0][0].fail(exc)
                return
            log.warning("a batched step failed; running its jobs one by one to find the failing one")
            for item in items:
                self._run_isolated([item], run_packed)

    def _run_isolated(self, items: list[tuple[JobState, Work]], run) -> None:
        state = items[0][0]
        try:
            self._forward(items, run)
        except KVLoadError as exc:
            state.recompute(exc)
        except torch.OutOfMemoryError:
            state.fail(MemoryError("the device is out of memory"), status=503, code="memory_pressure")
        except Exception as exc:  # a bug ends this job only, never the worker
            state.fail(exc)

    def _forward(self, items: list[tuple[JobState, Work]], run) -> None:
        lm = items[0][0].lm
        logits = run(lm, [w for _, w in items])
        self.steps += 1
        for (state, work), row in zip(items, logits, strict=True):
            state.advance(work.tokens, row)

    # -- helpers --------------------------------------------------------------------------------------

    def _publish_queue(self) -> None:
        """Tell the stores what the queue looks like whenever it changed (scheduler-aware eviction)."""
        if self._on_queue_change is None:
            return
        with self._cond:
            pending = list(self._pending)
        prefilling = [s for s in self._running if not s.finished and s.prefilling]
        seen = (tuple(id(j) for j in pending), tuple(id(s) for s in prefilling))
        if seen == self._queue_seen:
            return
        self._queue_seen = seen
        try:
            self._on_queue_change(prefilling, pending)
        except Exception:  # a hint only, like prefetch
            log.warning("publishing the queue to the store failed", exc_info=True)

    def _safe_prefetch(self, job: Job) -> None:
        try:
            self._prefetch(job)
        except Exception:  # a hint only: never let it hurt the jobs that are running
            log.warning("prefetch failed", exc_info=True)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            jobs = [s.job for s in self._running if not s.finished] + list(self._pending)
            self._running.clear()
            self._pending.clear()
        for job in jobs:
            job.emit(Failed(message))
