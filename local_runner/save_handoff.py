"""The save hand-off: the thread that ends the embedded engine's jobs off the step. A job that ended gives
its KV to the store (which keeps only the chunks it lacks), reports `Finished` and frees its pages here,
and pages whose restore is still writing into them wait here for that restore, so a step never waits on
a save or a restore settling.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from .job_kv import JobKV
from .job_state import JobState
from .scheduler import Scheduler

log = logging.getLogger("attnstore.runner")


class SaveHandoff:
    """Owns its one thread; gives each job's pages back through the scheduler once the job is over."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="attnstore-save-handoff")

    def save(self, state: JobState) -> None:
        """A job that ended in the last step (its last text is out): save its KV, report its end, free its
        pages, on the hand-off's thread (here while shutting down)."""
        try:
            self._thread.submit(self._save, state)
        except RuntimeError:  # shutting down: save here
            self._save(state)

    def release_after_restore(self, kv: JobKV, state: JobState | None) -> None:
        """A job that could not start gives its pages back, after any restore still writing into them has
        finished (on the hand-off's thread, so the step never waits for it)."""
        if state is not None and state.restore_pending:
            self._thread.submit(self._release_when_restored, state)
        else:
            kv.release()

    def close(self) -> None:
        """Pending saves finish: a restart finds their KV."""
        self._thread.shutdown(wait=True)

    def _release_when_restored(self, state: JobState) -> None:
        if state.restored is not None:
            state.restored.wait_ready(None)
        self._scheduler.release(state)

    def _save(self, state: JobState) -> None:
        try:
            state.save()
        except Exception:
            log.exception("the save hand-off failed; the answer is unaffected")
        finally:
            self._scheduler.release(state)
