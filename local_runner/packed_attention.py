"""Selective batching (Orca) with batched attention: one forward over the new tokens of every running job.

The dense work of a step (embeddings, projections, MLP, norms, logits) runs once over all jobs' tokens
packed as one sequence: decoding is memory-bound, so reading the weights once for 8 jobs costs little
more than for one. Attention is where jobs differ: each job's queries attend to its own K/V only, which
lives in its slot of the model's KV pool (kv_slots.py). Per layer, a step does:

- one write of every new token's K and V into its job's slot (one indexed copy for the whole step);
- ONE attention call for all decoding jobs: their queries against the pool's rows [lo, hi) of the slots
  they occupy, each row masked past its own job's length (rows of other slots are computed and
  dropped); with very uneven lengths the longest jobs attend on their own, so a short job never pays
  for a long one's keys (see `_split_outliers`);
- one call per job whose prompt is being prefilled (a chunk of many queries: causal within the chunk).

`batch_invariant`: every decoding job attends alone, over exactly its own length, so its result cannot
depend on which other jobs share the step (the batched call pads rows to the longest job, which changes
the order of the floating-point sums); and every prompt token attends the same way, row by row, so KV
computed in a prompt chunk equals KV computed a token at a time (reuse exact in every dtype). See
README, "Batch invariance".

How it plugs into transformers without model-specific code: the model runs with an attention function
registered under `PACKED` (AttentionInterface), every token gets its own job's position (`position_ids`),
and the step's `PackedPlan` reaches the attention function as an extra forward keyword. Called without
a plan (plain `model.generate`, say), the function is ordinary SDPA, so switching a model to it changes
nothing for anyone else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .job_kv import JobKV
from .kv_slots import SlotPool

PACKED = "attnstore_packed"
PLAN_KWARG = "attnstore_plan"

# Decoder-only models whose attention modules call the registered attention function with
# [batch, heads, tokens, head_dim] RoPE-rotated Q/K/V and carry `layer_idx`: they take the packed step.
PACKABLE_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})

# A decoding job attends on its own when the batched call would read this many times more keys than
# the jobs hold (rows padded to the longest job).
OUTLIER_WASTE = 2.0


@dataclass
class Segment:
    """One job's new tokens in the packed step: query rows [offset, offset + n) of the packed sequence."""

    kv: JobKV
    offset: int
    n: int


@dataclass
class _PoolGroup:
    """The step's segments whose jobs share one KV pool, with the index tensors every layer reuses."""

    pool: SlotPool
    segments: list[Segment]
    rows: torch.Tensor  # packed rows of these segments' tokens
    slots: torch.Tensor  # each such token's slot
    positions: torch.Tensor  # each such token's position in its slot
    decode: list[Segment]  # one-token segments attending together
    decode_alone: list[Segment]  # one-token segments attending on their own
    prefill: list[Segment]


@dataclass
class PackedPlan:
    segments: list[Segment]
    batch_invariant: bool = False
    _groups: list[_PoolGroup] | None = None
    _masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _decode_masks: dict[int, tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )

    def groups(self, device: torch.device) -> list[_PoolGroup]:
        if self._groups is None:
            self._groups = _group(self.segments, device, self.batch_invariant)
        return self._groups

    def causal_mask(self, n: int, past: int, device: torch.device) -> torch.Tensor:
        """Causal mask of n new queries over past + n keys (query i sees keys up to past + i)."""
        key = (n, past)
        m = self._masks.get(key)
        if m is None:
            m = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)
            self._masks[key] = m
        return m

    def decode_layout(self, g: _PoolGroup) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lo, keys, slot rows, packed rows, mask) of a group's batched decode call, built once per step:
        pool rows [lo, lo + len(mask)), `keys` = the longest job's length, mask [rows, 1, 1, keys]."""
        cached = self._decode_masks.get(id(g))
        if cached is not None:
            return cached
        dev = g.rows.device
        slots = [s.kv.slot for s in g.decode]
        lengths = [s.kv.length + 1 for s in g.decode]
        lo, hi, keys = min(slots), max(slots) + 1, max(lengths)
        per_row = torch.zeros(hi - lo, dtype=torch.long, device=dev)
        slot_rows = torch.tensor([s - lo for s in slots], dtype=torch.long, device=dev)
        per_row[slot_rows] = torch.tensor(lengths, dtype=torch.long, device=dev)
        mask = (torch.arange(keys, device=dev) < per_row[:, None])[:, None, None, :]
        rows = torch.tensor([s.offset for s in g.decode], dtype=torch.long, device=dev)
        out = (lo, keys, slot_rows, rows, mask)
        self._decode_masks[id(g)] = out
        return out


def _split_outliers(decode: list[Segment]) -> tuple[list[Segment], list[Segment]]:
    """Jobs that attend together, and the longest ones that attend alone: the batched call reads every
    row up to the longest job, so long outliers go alone until that costs at most OUTLIER_WASTE x the
    keys the jobs hold."""
    together = sorted(decode, key=lambda s: s.kv.length)
    alone: list[Segment] = []
    while len(together) > 1:
        held = sum(s.kv.length + 1 for s in together)
        if len(together) * (together[-1].kv.length + 1) <= OUTLIER_WASTE * held:
            break
        alone.append(together.pop())
    return together, alone


def _group(segments: list[Segment], device: torch.device, invariant: bool) -> list[_PoolGroup]:
    by_pool: dict[int, list[Segment]] = {}
    for seg in segments:
        by_pool.setdefault(id(seg.kv.pool), []).append(seg)
    groups = []
    for segs in by_pool.values():
        rows: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        for s in segs:
            rows.extend(range(s.offset, s.offset + s.n))
            slots.extend([s.kv.slot] * s.n)
            positions.extend(range(s.kv.length, s.kv.length + s.n))
        ones = [s for s in segs if s.n == 1]
        together, alone = ([], ones) if invariant else _split_outliers(ones)
        if len(together) == 1:
            together, alone = [], alone + together
        groups.append(
            _PoolGroup(
                pool=segs[0].kv.pool,
                segments=segs,
                rows=torch.tensor(rows, dtype=torch.long, device=device),
                slots=torch.tensor(slots, dtype=torch.long, device=device),
                positions=torch.tensor(positions, dtype=torch.long, device=device),
                decode=together,
                decode_alone=alone,
                prefill=[s for s in segs if s.n > 1],
            )
        )
    return groups


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    plan: PackedPlan | None = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [tokens, heads, head_dim]
    for g in plan.groups(query.device):
        _attend_group(plan, g, layer, query, key, value, scaling, out)
    return out.unsqueeze(0), None


def _attend_group(
    plan: PackedPlan,
    g: _PoolGroup,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    out: torch.Tensor,
) -> None:
    for seg in g.segments:
        seg.kv.layer(layer)  # a restored layer must have arrived (and a shift moved it) before we read
    k_pool, v_pool = g.pool.layer(layer)
    # Every new token's K/V into its job's slot, at its position: one indexed copy each for K and V.
    k_pool[g.slots, :, g.positions] = key[0, :, g.rows].transpose(0, 1)
    v_pool[g.slots, :, g.positions] = value[0, :, g.rows].transpose(0, 1)
    heads, head_dim = query.shape[1], query.shape[3]
    kv_heads = k_pool.shape[1]
    if g.decode:
        lo, keys, slot_rows, rows, mask = plan.decode_layout(g)
        n_rows = mask.shape[0]
        # Fold the query heads that share a K/V head into the query axis: SDPA then runs plain
        # attention against the un-expanded K/V of each slot.
        q = query.new_zeros(n_rows, kv_heads, heads // kv_heads, head_dim)
        q[slot_rows] = (
            query[0, :, rows]
            .reshape(kv_heads, heads // kv_heads, len(g.decode), head_dim)
            .permute(2, 0, 1, 3)
        )
        o = F.scaled_dot_product_attention(
            q,
            k_pool[lo : lo + n_rows, :, :keys],
            v_pool[lo : lo + n_rows, :, :keys],
            attn_mask=mask,
            scale=scaling,
        )
        out[rows] = o[slot_rows].reshape(len(g.decode), heads, head_dim)
    for seg in g.decode_alone:
        _attend_row(query, k_pool, v_pool, seg.kv.slot, seg.offset, seg.kv.length + 1, scaling, out)
    for seg in g.prefill:
        if plan.batch_invariant:
            # Row by row, each exactly as a decoding token attends: the flash kernel rounds a row of a
            # causal chunk differently with the chunk's length, so stored KV (computed in the chunks
            # of earlier turns, its answers a token at a time) would not equal a recompute's.
            for j in range(seg.n):
                _attend_row(
                    query, k_pool, v_pool, seg.kv.slot, seg.offset + j, seg.kv.length + j + 1, scaling, out
                )
            continue
        past, n, slot = seg.kv.length, seg.n, seg.kv.slot
        o = F.scaled_dot_product_attention(
            query[:, :, seg.offset : seg.offset + n],
            k_pool[slot : slot + 1, :, : past + n],
            v_pool[slot : slot + 1, :, : past + n],
            attn_mask=None if past == 0 else plan.causal_mask(n, past, query.device),
            is_causal=past == 0,
            scale=scaling,
            enable_gqa=True,
        )
        out[seg.offset : seg.offset + n] = o[0].transpose(0, 1)


def _attend_row(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot: int,
    row: int,
    end: int,
    scaling: float | None,
    out: torch.Tensor,
) -> None:
    """One token's query (packed row `row`) against its slot's keys [0, end): the query heads that share a
    K/V head folded into the query axis, so K/V are never expanded."""
    heads, head_dim = query.shape[1], query.shape[3]
    kv_heads = k_pool.shape[1]
    q = query[:, :, row].reshape(1, kv_heads, heads // kv_heads, head_dim)
    o = F.scaled_dot_product_attention(
        q, k_pool[slot : slot + 1, :, :end], v_pool[slot : slot + 1, :, :end], scale=scaling
    )
    out[row] = o.reshape(heads, head_dim)


def register() -> None:
    """Make `PACKED` a valid attention implementation (idempotent)."""
    AttentionInterface.register(PACKED, packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED, sdpa_mask)


def can_pack(config: Any) -> str | None:
    """None when the model can take the packed step, else why it cannot."""
    model_type = getattr(config, "model_type", "")
    if model_type not in PACKABLE_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(sorted(PACKABLE_MODEL_TYPES))}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        window = config.sliding_window
        if window < getattr(config, "max_position_embeddings", 0):
            return f"sliding-window attention ({window} tokens)"
    return None


def use_packed_attention(model: Any) -> None:
    """Switch a model's attention to `PACKED` (plain SDPA for any caller that passes no plan)."""
    register()
    model.set_attn_implementation(PACKED)
