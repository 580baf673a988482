"""How one loaded model computes a runner's steps: the step's kind (all jobs packed into one forward, or
one forward per job), its forward (decoder.py's loop or transformers'), its KV pool, and batch
invariance. The Runner owns one per model and asks it for nothing else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .decoder import DecoderStack
from .dense import make_rows_invariant
from .kv_slots import SlotPool, cuda_capacity
from .loader import LoadedModel
from .packed_attention import can_pack, use_packed_attention
from .step import Work, run_packed, run_per_job

log = logging.getLogger("attnstore.runner")


@dataclass
class ModelStep:
    lm: LoadedModel
    packed: bool  # every running job in one forward per step (else one forward per job)
    stack: DecoderStack | None  # the packed step's forward when the model has Llama's layers
    pool: SlotPool
    batch_invariant: bool

    @classmethod
    def prepare(
        cls, lm: LoadedModel, *, slots: int, context: int, batch: bool, batch_invariant: bool
    ) -> ModelStep:
        """`batch=False`: one forward per job for this model (a benchmark's same-run baseline)."""
        if batch_invariant:  # before the stack is built, so that it calls the wrapped layers
            _make_rows_invariant(lm)
        packed = batch and _takes_packed_step(lm)
        stack = _decoder_stack(lm) if packed else None
        return cls(lm, packed, stack, _make_pool(lm, slots, context), batch_invariant)

    def forward(self, work: list[Work]) -> list[torch.Tensor | None]:
        if self.packed:
            return run_packed(self.lm, work, batch_invariant=self.batch_invariant, stack=self.stack)
        return run_per_job(self.lm, work)

    def describe(self) -> dict[str, object]:
        """Where and how the model runs (for /healthz)."""
        return {
            "device": str(self.lm.device),
            "dtype": str(self.lm.dtype).removeprefix("torch."),
            "batched": self.packed,
            "batch_invariant": self.batch_invariant,
            "dense": self.lm.dense,
            "kv_slots": self.pool.slots,
            "context": self.pool.capacity,
        }


def _takes_packed_step(lm: LoadedModel) -> bool:
    """Llama-style decoders take the packed (batched) step; any other model runs one job per forward."""
    reason = can_pack(lm.model.config)
    if reason is None:
        use_packed_attention(lm.model)
        return True
    log.info("model %s: one forward per job (no batched steps): %s", lm.name, reason)
    return False


def _decoder_stack(lm: LoadedModel) -> DecoderStack | None:
    reason = DecoderStack.unfit(lm.model)
    if reason is None:
        return DecoderStack(lm.model)
    log.info("model %s: the packed step runs the transformers forward: %s", lm.name, reason)
    return None


def _make_rows_invariant(lm: LoadedModel) -> None:
    """batch_invariant: a row's product must not depend on the rows beside it. The linear layers are
    wrapped once per loaded model (dense.make_rows_invariant: measured per shape, padded tiles where the
    kernel depends on the row count); a failed check is said, not hidden."""
    if lm.rows_invariant is None:
        lm.rows_invariant = make_rows_invariant(lm.model, lm.dtype, lm.device)
        if not lm.rows_invariant:
            log.warning("model %s: batch_invariant: a linear layer still depends on the batch here", lm.name)


def _make_pool(lm: LoadedModel, slots: int, context: int) -> SlotPool:
    """The model's KV pool: a slot per running job, each with room for `context` tokens (on the CPU
    pages are taken only as jobs write them; on CUDA the context a job may hold is cut to what half of
    the free device memory can give every slot)."""
    if lm.device.type == "cuda":
        fit = cuda_capacity(lm.layout, lm.device, slots, context)
        if fit < context:
            log.warning(
                "model %s: %d KV slots of %d tokens fit the device; prompt + answer is limited to that",
                lm.name,
                slots,
                fit,
            )
        context = fit
    return SlotPool(lm.layout, lm.device, slots, context)
