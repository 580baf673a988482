"""One forward for a step's work: packed (every job in one forward) or per job, for other architectures.

The caller plans the step (which jobs, how many tokens each); this module only runs it. A job's KV
length advances only when the whole forward succeeded, so a failed step can be retried as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .job_kv import JobKV
from .kv_cache import job_cache
from .loader import LoadedModel
from .packed_attention import PLAN_KWARG, PackedPlan, Segment
from .sampling import RowLogits, StepLogits
from .triton_attention import AttentionConfig


class PackedForward(Protocol):
    """decoder.py's DecoderStack or compiled.py's CompiledStack: logits of the rows `keep`."""

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, plan: PackedPlan
    ) -> torch.Tensor: ...


@dataclass
class Work:
    """Tokens to feed one job in this step; `want_logits` when the next token is sampled after them."""

    kv: JobKV
    tokens: list[int]
    want_logits: bool


@torch.inference_mode()
def run_packed(
    lm: LoadedModel,
    work: list[Work],
    *,
    batch_invariant: bool = False,
    stack: PackedForward | None = None,
    attention: AttentionConfig | None = None,
) -> list[RowLogits | None]:
    """All jobs' new tokens as one sequence, each at its own positions; decoding jobs attend in one
    batched call per layer (or each alone with `batch_invariant`), see packed_attention. With `stack`
    the forward is decoder.py's loop over the model's modules, else the transformers forward.
    `attention`: the paged kernel's config on CUDA (the engine's default where None)."""
    # Decoding jobs first, oldest first, then prompt chunks: a decode-only step's layout then depends on
    # its jobs alone (the CUDA step replays one graph per batch size for it).
    order = sorted(range(len(work)), key=lambda i: (len(work[i].tokens) > 1, work[i].kv.id))
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    keep: list[int] = []
    for w in (work[i] for i in order):
        n = len(w.tokens)
        w.kv.ensure(w.kv.length + n)  # pages for the new tokens (kv_pages.PoolExhausted when short)
        segments.append(Segment(w.kv, len(ids), n))
        positions.extend(range(w.kv.length, w.kv.length + n))
        ids.extend(w.tokens)
        if w.want_logits:
            keep.append(len(ids) - 1)
    dev = lm.device
    plan = PackedPlan(segments, batch_invariant, attention=attention)
    ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
    positions_t = torch.tensor(positions, dtype=torch.long, device=dev)
    keep_t = torch.tensor(keep, dtype=torch.long, device=dev)
    if stack is not None:
        logits = stack.forward(ids_t, positions_t, keep_t, plan)
    else:
        out = lm.model(
            input_ids=ids_t[None],
            position_ids=positions_t[None],
            use_cache=False,
            logits_to_keep=keep_t,
            **{PLAN_KWARG: plan},
        )
        logits = out.logits[0]
    step_logits = StepLogits(logits)
    result: list[RowLogits | None] = [None] * len(work)
    row = 0
    for i in order:
        w = work[i]
        w.kv.length += len(w.tokens)
        if w.want_logits:
            result[i] = step_logits.row(row)
            row += 1
    return result


@torch.inference_mode()
def run_per_job(lm: LoadedModel, work: list[Work]) -> list[RowLogits | None]:
    """One forward per job through a transformers cache over its buffers (any causal LM)."""
    result: list[RowLogits | None] = []
    for w in work:
        out = lm.model(
            input_ids=torch.tensor([w.tokens], dtype=torch.long, device=lm.device),
            cache=job_cache(lm.model.config, w.kv),
            use_cache=True,
            logits_to_keep=1,
        )
        w.kv.length += len(w.tokens)
        result.append(StepLogits(out.logits[0, -1:]).row(0) if w.want_logits else None)
    return result
