"""The one thread that owns the models: schedule -> run -> postprocess, step after step (nano-vllm's
`LLMEngine.step`).

    schedule     admit waiting jobs that fit (round-robin between clients) and start them (lookup,
                 restore into their slot); tell the stores what the queue looks like and prefetch the
                 look-ahead window; plan the step (scheduler.py)
    run          one forward for the step's work: packed (every job of a model in one forward, decoding
                 jobs attending in one call per layer) or one forward per job for other architectures;
                 the logits are kept for postprocess (a forward that fails is retried or ends its jobs)
    postprocess  each job takes its tokens (sample, stream text, stop); jobs that ended go to the save
                 hand-off, a thread of their own that gives their KV to the store, reports `Finished`
                 and frees the slot, so a step never waits on a save or a restore settling

Compute never runs on the event loop, and a failure ends the failing job only, never the worker.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from kvtier import KVLoadError

from .job_kv import JobKV
from .job_state import JobState
from .jobs import Failed, Finished, Job, Outbox
from .scheduler import Scheduler
from .step import Work

log = logging.getLogger("attnstore.runner")


class EngineHooks(Protocol):
    """What the worker needs from the engine that owns the models and stores (engine.py implements it).
    Every hook runs on the worker's thread."""

    def warmup(self) -> None: ...

    def start_job(self, job: Job, kv: JobKV) -> JobState: ...

    def admission_error(self, job: Job) -> str | None: ...

    def publish_queue(self, prefilling: list[JobState], waiting: list[Job]) -> None: ...

    def prefetch(self, job: Job) -> None: ...

    def free_device_memory(self) -> bool: ...

    def run(self, items: list[tuple[JobState, Work]]) -> list[torch.Tensor | None]: ...

    def packed(self, state: JobState) -> bool: ...


class Worker:
    """The loop's thread, started by `start()` (the engine's, once it is fully built).

    Owns `steps` and `outbox`, both written by its thread only, without a lock: the outbox takes emits
    from that thread alone (`Outbox.thread`) and hands them to each loop in one thread-safe call per
    step; `steps` is read unlocked for stats. The queue, the running jobs and their counters are the
    scheduler's (it changes them, under `scheduler.cond`); the worker only calls its methods."""

    def __init__(self, scheduler: Scheduler, hooks: EngineHooks) -> None:
        self.scheduler = scheduler
        self._hooks = hooks
        self._queue_seen: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self._prefetched: set[int] = set()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="attnstore-save-handoff")
        self.steps = 0  # forwards run (a packed step counts once)
        # What this step's forwards fed and the logits they gave, per job: run fills it, postprocess
        # samples from it (worker's thread only).
        self._results: list[tuple[JobState, list[int], torch.Tensor | None]] = []
        self.outbox = Outbox()  # the events of a step, handed to the event loop once per step
        self._thread = threading.Thread(target=self._run, name="attnstore-runner", daemon=True)
        self.outbox.thread = self._thread

    def start(self) -> None:
        """Start the worker's thread (the engine does, once it is fully built)."""
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        for job in self.scheduler.stop():
            job.emit(Failed("the local runner stopped"))
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)
        self._saver.shutdown(wait=True)  # pending saves finish: a restart finds their KV

    # -- the loop -------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._hooks.warmup()
        except Exception:  # a slower first request is all a failed warm-up costs
            log.warning("warm-up failed", exc_info=True)
        while self.scheduler.wait_for_work():
            try:
                self._schedule()
                plan = self.scheduler.plan()
                if plan:
                    self._step(plan)
                self._postprocess()
            finally:
                self.outbox.flush()
        self.outbox.flush()

    # -- schedule -------------------------------------------------------------------------------------

    def _schedule(self) -> None:
        self.scheduler.resume_preempted()
        for job, kv in self.scheduler.admit():
            self._prefetched.discard(id(job))
            self.scheduler.started(self._start(job, kv))
        waiting = self.scheduler.window()
        self._publish_queue(waiting)
        for job in waiting[: self.scheduler.config.lookahead]:
            if id(job) not in self._prefetched:
                self._prefetched.add(id(job))
                self._safe(self._hooks.prefetch, job, what="prefetch")
        self.scheduler.end_cancelled()

    def _start(self, job: Job, kv: JobKV) -> JobState | None:
        """A job taken from the queue with its pages: refuse it (memory pressure), or look its prefix up
        and start its restore. A device out of memory while starting demotes L0 and retries once."""
        if job.cancelled:  # its client left while it was being admitted
            job.emit(Finished("cancelled", len(job.request.prompt_ids), 0, 0))
            kv.release()
            return None
        refusal = self._hooks.admission_error(job)
        if refusal is not None:
            job.emit(Failed(refusal, status=503, code="memory_pressure"))
            kv.release()
            return None
        for attempt in (1, 2):
            state = None
            try:
                state = self._hooks.start_job(job, kv)
                state.begin()
                return state
            except torch.OutOfMemoryError:
                self._abandon(state)
                if attempt == 1 and self._hooks.free_device_memory():
                    continue
                job.emit(
                    Failed("the device is out of memory; retry later", status=503, code="memory_pressure")
                )
            except Exception as exc:
                log.exception("could not start a job")
                self._abandon(state)
                job.emit(Failed(f"could not start: {exc}"))
            break
        self._release_after_restore(kv, state)
        return None

    @staticmethod
    def _abandon(state: JobState | None) -> None:
        """A job that could not start lets go of its pins now (not when the garbage collector runs)."""
        if state is not None:
            state.release_pins()

    def _release_after_restore(self, kv: JobKV, state: JobState | None) -> None:
        """Give a job's pages back, after any restore still writing into them has finished (on the
        hand-off thread, so the step never waits for it)."""
        if state is not None and state.restore_pending:
            self._saver.submit(self._release_when_restored, state)
        else:
            kv.release()

    def _release_when_restored(self, state: JobState) -> None:
        if state.restored is not None:
            state.restored.wait_ready(None)
        self.scheduler.release(state)

    def _publish_queue(self, waiting: list[Job]) -> None:
        """Tell the stores what the queue looks like whenever it changed (scheduler-aware eviction)."""
        prefilling = [s for s in self.scheduler.running if s.computing and s.prefilling]
        seen = (tuple(id(j) for j in waiting), tuple(id(s) for s in prefilling))
        if seen == self._queue_seen:
            return
        self._queue_seen = seen
        self._prefetched &= {id(j) for j in waiting}
        self._safe(self._hooks.publish_queue, prefilling, waiting, what="publishing the queue")

    # -- run ------------------------------------------------------------------------------------------

    def _step(self, plan: list[tuple[JobState, Work]]) -> None:
        by_model: dict[int, list[tuple[JobState, Work]]] = {}
        for item in plan:
            by_model.setdefault(id(item[0].lm), []).append(item)
        for items in by_model.values():
            if self._hooks.packed(items[0][0]):
                self._run_packed(items)
            else:
                for item in items:
                    self._run_isolated([item])

    def _run_packed(self, items: list[tuple[JobState, Work]]) -> None:
        try:
            self._forward(items)
        except torch.OutOfMemoryError:
            freed = self._hooks.free_device_memory()
            for item in items:
                if freed:
                    self._run_isolated([item])
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
                self._run_isolated([item])

    def _run_isolated(self, items: list[tuple[JobState, Work]]) -> None:
        """One job's work alone. A device out of memory demotes L0 (with evict_on_pressure) and runs it
        once more before the job fails."""
        state = items[0][0]
        for attempt in (1, 2):
            try:
                self._forward(items)
            except KVLoadError as exc:
                state.recompute(exc)
            except torch.OutOfMemoryError:
                if attempt == 1 and self._hooks.free_device_memory():
                    continue
                state.fail(MemoryError("the device is out of memory"), status=503, code="memory_pressure")
            except Exception as exc:  # a bug ends this job only, never the worker
                state.fail(exc)
            return

    def _forward(self, items: list[tuple[JobState, Work]]) -> None:
        logits = self._hooks.run(items)
        results = [(state, work.tokens, row) for (state, work), row in zip(items, logits, strict=True)]
        self.steps += 1
        self._results.extend(results)

    # -- postprocess ----------------------------------------------------------------------------------

    def _postprocess(self) -> None:
        results, self._results = self._results, []
        for state, fed, logits in results:
            state.advance(fed, logits)  # sample, stream text, stop (never raises: a failure ends the job)
        ended = self.scheduler.ended()
        if ended:  # their last text goes to the loop before the save hand-off can send `Finished`
            self.outbox.flush()
        for state in ended:
            try:
                self._saver.submit(self._save, state)
            except RuntimeError:  # shutting down: save here
                self._save(state)

    def _save(self, state: JobState) -> None:
        try:
            state.save()
        except Exception:
            log.exception("the save hand-off failed; the answer is unaffected")
        finally:
            self.scheduler.release(state)

    @staticmethod
    def _safe(fn, *args, what: str) -> None:
        try:
            fn(*args)
        except Exception:  # a hint only (prefetch, schedule): never let it hurt the running jobs
            log.warning("%s failed", what, exc_info=True)
