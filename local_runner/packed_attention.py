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

`batch_invariant` (the default): every row computed the same way whatever shares the call, so a job's
result cannot depend on which other jobs share the step, and KV computed in a prompt chunk equals KV
computed a token at a time (reuse exact in every dtype): on the CPU ONE call of exact_kernel for every
token of the step; where that kernel is not built, the calls below made by exact_attention.py (keys in
whole blocks, products of a fixed minimum row count). Without it, torch's flash attention, whose
rounding depends on the call's shape. See docs/engine.md, "Batch invariance".

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

from . import exact_attention, exact_kernel
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
class _Decode:
    """A group's batched decode call, laid out once per step (every layer reuses it): the decoding jobs'
    queries against pool rows [lo, lo + rows) up to `keys` keys, `mask` [rows, 1, 1, keys]
    (additive, in the model's dtype) hiding each row's keys past its own job's length. `slot_rows` places
    each job's query in its slot's row, `packed` names the jobs' rows of the packed sequence; either is
    None where it is the identity (slots lo, lo + 1, ... in order; packed rows a contiguous range
    `packed_range`), so the common step gathers and scatters nothing."""

    lo: int
    rows: int
    keys: int
    mask: torch.Tensor
    lengths: list[int]  # each row's keys (1 for a free slot between the jobs: never read)
    slot_rows: torch.Tensor | None
    packed: torch.Tensor | None
    packed_range: tuple[int, int]
    _exact_bias: torch.Tensor | None = None

    def exact_bias(self, capacity: int, device: torch.device) -> torch.Tensor:
        """exact_attention's mask of these rows, made by the first layer and reused by the others."""
        if self._exact_bias is None:
            self._exact_bias = exact_attention.decode_bias(self.lengths, capacity, device)
        return self._exact_bias


@dataclass
class _PoolGroup:
    """The step's segments whose jobs share one KV pool, with the index tensors every layer reuses."""

    pool: SlotPool
    segments: list[Segment]
    rows: torch.Tensor | None  # packed rows of these segments' tokens (None: all rows, in order)
    slots: torch.Tensor  # each such token's slot
    positions: torch.Tensor  # each such token's position in its slot
    lengths: torch.Tensor  # each such token's keys, itself included (positions + 1: the exact kernel's)
    decode: _Decode | None  # one-token segments attending together
    decode_alone: list[Segment]  # one-token segments attending on their own
    prefill: list[Segment]
    pending: list[JobKV]  # jobs whose restored layers may not all have arrived yet


@dataclass
class PackedPlan:
    segments: list[Segment]
    batch_invariant: bool = False
    _groups: list[_PoolGroup] | None = None
    _masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # exact_attention's masks of this step (the same for every layer), by the key their maker gives
    exact_biases: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)

    def groups(self, device: torch.device, dtype: torch.dtype) -> list[_PoolGroup]:
        if self._groups is None:
            self._groups = _group(self.segments, device, dtype)
        return self._groups

    def causal_mask(self, n: int, past: int, device: torch.device) -> torch.Tensor:
        """Causal mask of n new queries over past + n keys (query i sees keys up to past + i)."""
        key = (n, past)
        m = self._masks.get(key)
        if m is None:
            m = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)
            self._masks[key] = m
        return m


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


def _decode_layout(together: list[Segment], device: torch.device, dtype: torch.dtype) -> _Decode:
    together = sorted(together, key=lambda s: s.kv.slot)
    slots = [s.kv.slot for s in together]
    lengths = [s.kv.length + 1 for s in together]
    lo, hi, keys = slots[0], slots[-1] + 1, max(lengths)
    per_row = torch.zeros(hi - lo, dtype=torch.long)
    per_row[torch.tensor(slots) - lo] = torch.tensor(lengths)
    hidden = torch.arange(keys)[None, :] >= per_row[:, None]
    mask = torch.zeros(hi - lo, 1, 1, keys, dtype=dtype).masked_fill_(hidden[:, None, None, :], float("-inf"))
    offsets = [s.offset for s in together]
    first = offsets[0]
    contiguous = offsets == list(range(first, first + len(offsets)))
    return _Decode(
        lo=lo,
        rows=hi - lo,
        keys=keys,
        mask=mask.to(device),
        lengths=per_row.clamp(min=1).tolist(),
        slot_rows=None if hi - lo == len(slots) else torch.tensor([s - lo for s in slots], device=device),
        packed=None if contiguous else torch.tensor(offsets, device=device),
        packed_range=(first, first + len(offsets)),
    )


def _group(segments: list[Segment], device: torch.device, dtype: torch.dtype) -> list[_PoolGroup]:
    by_pool: dict[int, list[Segment]] = {}
    for seg in segments:
        by_pool.setdefault(id(seg.kv.pool), []).append(seg)
    total = sum(s.n for s in segments)
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
        together, alone = _split_outliers(ones)
        if len(together) == 1:
            together, alone = [], alone + together
        groups.append(
            _PoolGroup(
                pool=segs[0].kv.pool,
                segments=segs,
                rows=None
                if rows == list(range(total))
                else torch.tensor(rows, dtype=torch.long, device=device),
                slots=torch.tensor(slots, dtype=torch.long, device=device),
                positions=torch.tensor(positions, dtype=torch.long, device=device),
                lengths=torch.tensor(positions, dtype=torch.long, device=device) + 1,
                decode=_decode_layout(together, device, dtype) if together else None,
                decode_alone=alone,
                prefill=[s for s in segs if s.n > 1],
                pending=[s.kv for s in segs if s.kv.restoring],
            )
        )
    return groups


def attend(
    plan: PackedPlan, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One layer's attention for a packed step, in the decoder's row layout: query [tokens, heads,
    head_dim], key and value [tokens, kv_heads, head_dim] in (views are fine), [tokens, heads, head_dim]
    out. Writes the new tokens' K/V into their jobs' slots first."""
    groups = plan.groups(query.device, query.dtype)
    if plan.batch_invariant and query.device.type == "cpu" and exact_kernel.ready(query.shape[-1]):
        return _exact_kernel_step(groups, layer, query, key, value, scaling)
    if len(groups) == 1 and _decode_only(groups[0], query.shape[0]):
        # no scatter into `out`
        return _decode_step(groups[0], layer, query, key, value, scaling, plan)
    out = query.new_empty(query.shape)
    for g in groups:
        _attend_group(plan, g, layer, query, key, value, scaling, out)
    return out


def _exact_kernel_step(
    groups: list[_PoolGroup],
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """`attend` by exact_kernel: one call per pool for every token of the step, decoding or prefilling,
    each attending to its own slot's keys up to its own position."""
    out: torch.Tensor | None = None
    for g in groups:
        k_pool, v_pool = _write_kv(g, layer, key, value)
        if g.rows is None:  # every token of the step is this pool's: the call's output is the result
            return exact_kernel.attend(query, k_pool, v_pool, g.slots, g.lengths, scaling)
        out = query.new_empty(query.shape) if out is None else out
        out[g.rows] = exact_kernel.attend(query[g.rows], k_pool, v_pool, g.slots, g.lengths, scaling)
    assert out is not None
    return out


def _decode_only(g: _PoolGroup, tokens: int) -> bool:
    """Every token of the step is a decoding token of this group, attending in one call or alone."""
    if g.prefill:
        return False
    if g.decode is None:
        return len(g.decode_alone) == 1
    d = g.decode
    return not g.decode_alone and d.slot_rows is None and d.packed is None and d.packed_range == (0, tokens)


def _write_kv(
    g: _PoolGroup, layer: int, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's new K/V into their slots (one indexed copy each for K and V); the layer's pool back."""
    for kv in g.pending:
        kv.layer(layer)  # a restored layer must have arrived (and a shift moved it) before we write or read
    k_pool, v_pool = g.pool.layer(layer)
    if g.rows is not None:
        key, value = key[g.rows], value[g.rows]
    k_pool[g.slots, :, g.positions] = key
    v_pool[g.slots, :, g.positions] = value
    return k_pool, v_pool


def _decode_step(
    g: _PoolGroup,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    plan: PackedPlan,
) -> torch.Tensor:
    """`attend` for a step of decoding tokens only, in slot order: the result is the call's own output."""
    k_pool, v_pool = _write_kv(g, layer, key, value)
    if g.decode is None:
        seg = g.decode_alone[0]
        return _row_attention(query[0], k_pool, v_pool, seg.kv.slot, seg.kv.length + 1, scaling, plan)[None]
    return _batched_decode(g.decode, query, k_pool, v_pool, scaling, plan.batch_invariant)


def _batched_decode(
    d: _Decode,
    queries: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scaling: float,
    exact: bool,
) -> torch.Tensor:
    """The decoding jobs' queries ([jobs, heads, head_dim], in slot order) in ONE call against their
    slots' K/V, each row masked past its own job's length; [jobs, heads, head_dim] out. The query heads
    that share a K/V head are folded into the query axis, so K/V are never expanded."""
    jobs, heads, head_dim = queries.shape
    kv_heads = k_pool.shape[1]
    rows = slice(d.lo, d.lo + d.rows)
    if exact:
        q = queries
        if d.slot_rows is not None:  # free slots between the jobs get zero queries (dropped after)
            q = queries.new_zeros(d.rows, heads, head_dim)
            q[d.slot_rows] = queries
        bias = d.exact_bias(k_pool.shape[2], q.device)
        o = exact_attention.decode_rows(q, k_pool[rows], v_pool[rows], bias, scaling)
        return o if d.slot_rows is None else o[d.slot_rows]
    q = queries.reshape(jobs, kv_heads, heads // kv_heads, head_dim)
    if d.slot_rows is not None:  # free slots between the jobs get zero queries, masked rows
        spread = q.new_zeros(d.rows, *q.shape[1:])
        spread[d.slot_rows] = q
        q = spread
    o = F.scaled_dot_product_attention(
        q, k_pool[rows, :, : d.keys], v_pool[rows, :, : d.keys], attn_mask=d.mask, scale=scaling
    )
    if d.slot_rows is not None:
        o = o[d.slot_rows]
    return o.reshape(jobs, heads, head_dim)


def _row_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot: int,
    end: int,
    scaling: float,
    plan: PackedPlan,
) -> torch.Tensor:
    """One token's query ([heads, head_dim]) against its slot's keys [0, end), query heads folded as in
    `_batched_decode`; [heads, head_dim] out."""
    heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    if plan.batch_invariant:
        bias = plan.exact_biases.get((-1, slot, end))
        if bias is None:
            bias = exact_attention.decode_bias([end], k_pool.shape[2], q.device)
            plan.exact_biases[(-1, slot, end)] = bias
        return exact_attention.decode_rows(
            q[None], k_pool[slot : slot + 1], v_pool[slot : slot + 1], bias, scaling
        )[0]
    o = F.scaled_dot_product_attention(
        q.reshape(1, kv_heads, heads // kv_heads, head_dim),
        k_pool[slot : slot + 1, :, :end],
        v_pool[slot : slot + 1, :, :end],
        scale=scaling,
    )
    return o.reshape(heads, head_dim)


def _attend_group(
    plan: PackedPlan,
    g: _PoolGroup,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    out: torch.Tensor,
) -> None:
    k_pool, v_pool = _write_kv(g, layer, key, value)
    exact = plan.batch_invariant
    d = g.decode
    if d is not None:
        first, end = d.packed_range
        rows = slice(first, end) if d.packed is None else d.packed
        out[rows] = _batched_decode(d, query[rows], k_pool, v_pool, scaling, exact)
    for seg in g.decode_alone:
        out[seg.offset] = _row_attention(
            query[seg.offset], k_pool, v_pool, seg.kv.slot, seg.kv.length + 1, scaling, plan
        )
    for seg in g.prefill:
        past, n, slot = seg.kv.length, seg.n, seg.kv.slot
        if exact:
            out[seg.offset : seg.offset + n] = exact_attention.prefill_rows(
                query[seg.offset : seg.offset + n],
                k_pool[slot],
                v_pool[slot],
                past,
                scaling,
                plan.exact_biases,
            )
            continue
        o = F.scaled_dot_product_attention(
            query[seg.offset : seg.offset + n].transpose(0, 1)[None],
            k_pool[slot : slot + 1, :, : past + n],
            v_pool[slot : slot + 1, :, : past + n],
            attn_mask=None if past == 0 else plan.causal_mask(n, past, query.device),
            is_causal=past == 0,
            scale=scaling,
            enable_gqa=True,
        )
        out[seg.offset : seg.offset + n] = o[0].transpose(0, 1)


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
    """The attention function registered under PACKED for transformers' own forward ([1, heads, tokens,
    head_dim] in, [1, tokens, heads, head_dim] out): `attend` with the step's plan, or plain SDPA when
    the caller passes no plan."""
    plan: PackedPlan | None = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return attend(plan, layer, q, k, v, scale).unsqueeze(0), None


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
