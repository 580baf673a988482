"""The run phase of the embedded engine's step: one forward per model over the step's work, each job's
logits kept for postprocess. Every job of a packed model shares one forward; a forward that fails is
retried or narrowed down to the failing job, which alone ends: never the engine's worker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from kvtier import KVLoadError

from .job_state import JobState
from .memory_guard import MemoryGuard
from .model_step import ModelStep
from .sampling import RowLogits
from .step import Work

log = logging.getLogger("attnstore.runner")

# One job's work in a step, as the scheduler plans it; and what its forward fed and the logits it gave.
StepItem = tuple[JobState, Work]
Result = tuple[JobState, list[int], RowLogits | None]


class StepRun:
    """Owns nothing between steps: `run` returns what its forwards gave."""

    def __init__(self, steps: Mapping[str, ModelStep], memory: MemoryGuard) -> None:
        self._steps = steps
        self._memory = memory

    def run(self, plan: list[StepItem]) -> list[Result]:
        results: list[Result] = []
        by_model: dict[str, list[StepItem]] = {}
        for item in plan:
            by_model.setdefault(item[0].job.request.model, []).append(item)
        for model, items in by_model.items():
            if self._steps[model].packed:
                self._packed(items, results)
            else:
                for item in items:
                    self._isolated([item], results)
        return results

    def _packed(self, items: list[StepItem], results: list[Result]) -> None:
        try:
            self._forward(items, results)
        except torch.OutOfMemoryError:
            freed = self._memory.free_device_memory()
            for item in items:
                if freed:
                    self._isolated([item], results)
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
                self._isolated([item], results)

    def _isolated(self, items: list[StepItem], results: list[Result]) -> None:
        """One job's work alone. A device out of memory demotes L0 (with evict_on_pressure) and runs it
        once more before the job fails."""
        state = items[0][0]
        for attempt in (1, 2):
            try:
                self._forward(items, results)
            except KVLoadError as exc:
                state.recompute(exc)
            except torch.OutOfMemoryError:
                if attempt == 1 and self._memory.free_device_memory():
                    continue
                state.fail(MemoryError("the device is out of memory"), status=503, code="memory_pressure")
            except Exception as exc:  # a bug ends this job only, never the worker
                state.fail(exc)
            return

    def _forward(self, items: list[StepItem], results: list[Result]) -> None:
        """One forward over the items' work (every item is of one model)."""
        logits = self._steps[items[0][0].job.request.model].forward([work for _, work in items])
        results += [(state, work.tokens, row) for (state, work), row in zip(items, logits, strict=True)]
