"""Selective batching (Orca) with batched attention: one forward over the new tokens of every running job.

The dense work of a step (embeddings, projections, MLP, norms, logits) runs once over all jobs' tokens
packed as one sequence: decoding is memory-bound, so reading the weights once for 8 jobs costs little
more than for one. Attention is where jobs differ: each job's queries attend to its own K/V only, which
lies in the pages its page table names (kv_pages.py). Per layer, a step does:

- one write of every new token's K and V into its job's pages (one indexed copy for the whole step);
- ONE attention call for every token of the step, decoding or prefilling, each attending to its own
  job's keys up to its own position, through the jobs' page tables: exact_attention.cpp's kernel on the
  CPU, triton_attention.py's on CUDA. Both compute a row the same way whatever shares its call, so a
  job's result never depends on which other jobs share the step, and KV computed in a prompt chunk
  equals KV computed a token at a time (docs/engine.md, "Batch invariance").

Where neither kernel runs (no C++ compiler on a CPU, no Triton on CUDA, a head size the kernels lack),
each job attends on its own over a gathered copy of its pages: exact_attention.py's padded calls with
`batch_invariant`, torch's SDPA without.

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

from . import exact_attention, exact_kernel, triton_attention
from .job_kv import JobKV
from .kv_pages import PagePool

PACKED = "attnstore_packed"
PLAN_KWARG = "attnstore_plan"

# Decoder-only models whose attention modules call the registered attention function with
# [batch, heads, tokens, head_dim] RoPE-rotated Q/K/V and carry `layer_idx`: they take the packed step.
PACKABLE_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


@dataclass
class Segment:
    """One job's new tokens in the packed step: query rows [offset, offset + n) of the packed sequence."""

    kv: JobKV
    offset: int
    n: int


@dataclass
class PoolGroup:
    """The step's segments whose jobs share one page pool, with the tensors every layer reuses: where
    each new token's K/V goes, and what each token attends to (its job's row of `tables`, its keys)."""

    pool: PagePool
    segments: list[Segment]
    rows: torch.Tensor | None  # packed rows of these segments' tokens (None: all rows, in order)
    write_pages: torch.Tensor  # each such token's page
    write_offsets: torch.Tensor  # its place in that page
    tables: torch.Tensor  # [jobs, width] int64 (int32 on CUDA): each job's pages in order, padded with 0
    jobs: torch.Tensor  # each token's row of `tables`
    lengths: torch.Tensor  # each token's keys, itself included (position + 1)
    pending: list[JobKV]  # jobs whose restored layers may not all have arrived yet
    kernel_meta: Any = None  # what triton_attention lays out once per step (CUDA)
    host_jobs: list[int] = field(default_factory=list)  # `jobs` and `lengths` as the host made them
    host_lengths: list[int] = field(default_factory=list)


@dataclass
class PackedPlan:
    segments: list[Segment]
    batch_invariant: bool = False
    _groups: list[PoolGroup] | None = None
    # exact_attention's masks of this step (the same for every layer), by the key their maker gives
    exact_biases: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    # The paged kernel's config on CUDA (the model's, kernel_choice.py); None: the engine's default
    attention: triton_attention.AttentionConfig | None = None

    def groups(self, device: torch.device) -> list[PoolGroup]:
        if self._groups is None:
            self._groups = _group(self.segments, device)
        return self._groups


def _group(segments: list[Segment], device: torch.device) -> list[PoolGroup]:
    by_pool: dict[int, list[Segment]] = {}
    for seg in segments:
        by_pool.setdefault(id(seg.kv.pool), []).append(seg)
    total = sum(s.n for s in segments)
    groups = []
    for segs in by_pool.values():
        rows: list[int] = []
        pages: list[int] = []
        offsets: list[int] = []
        jobs: list[int] = []
        lengths: list[int] = []
        for index, s in enumerate(segs):
            rows.extend(range(s.offset, s.offset + s.n))
            p, o = s.kv.token_slots(s.kv.length, s.kv.length + s.n)
            pages.extend(p)
            offsets.extend(o)
            jobs.extend([index] * s.n)
            lengths.extend(range(s.kv.length + 1, s.kv.length + s.n + 1))
        width = max(len(s.kv.pages) for s in segs)
        table = [s.kv.pages + [0] * (width - len(s.kv.pages)) for s in segs]
        index_type = torch.int32 if device.type == "cuda" else torch.long

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        groups.append(
            PoolGroup(
                pool=segs[0].kv.pool,
                segments=segs,
                rows=None if rows == list(range(total)) else tensor(rows),
                write_pages=tensor(pages),
                write_offsets=tensor(offsets),
                tables=tensor(table, index_type),
                jobs=tensor(jobs, index_type),
                lengths=tensor(lengths, index_type),
                pending=[s.kv for s in segs if s.kv.restoring],
                host_jobs=jobs,
                host_lengths=lengths,
            )
        )
    return groups


def attend(
    plan: PackedPlan, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One layer's attention for a packed step, in the decoder's row layout: query [tokens, heads,
    head_dim], key and value [tokens, kv_heads, head_dim] in (views are fine), [tokens, heads, head_dim]
    out. Writes the new tokens' K/V into their jobs' pages first."""
    groups = plan.groups(query.device)
    if len(groups) == 1 and groups[0].rows is None:  # every token of the step is this pool's
        return _attend_group(plan, groups[0], layer, query, key, value, scaling)
    out = query.new_empty(query.shape)
    for g in groups:
        assert g.rows is not None
        out[g.rows] = _attend_group(plan, g, layer, query[g.rows], key[g.rows], value[g.rows], scaling)
    return out


def _attend_group(
    plan: PackedPlan,
    g: PoolGroup,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    k_pages, v_pages = write_kv(g, layer, key, value)
    head_dim = query.shape[-1]
    if query.device.type == "cpu" and exact_kernel.ready(head_dim):
        return exact_kernel.attend(query, k_pages, v_pages, g.tables, g.jobs, g.lengths, scaling)
    if query.device.type == "cuda" and triton_attention.ready(head_dim, query.shape[1] // key.shape[1]):
        if g.kernel_meta is None:
            g.kernel_meta = triton_attention.plan(
                g.tables,
                g.host_jobs,
                g.host_lengths,
                query.shape[1],
                key.shape[1],
                plan.attention or triton_attention.config_for(query.dtype),
            )
        return triton_attention.attend(query, k_pages, v_pages, g.kernel_meta, scaling)
    return _per_job(plan, g, query, k_pages, v_pages, scaling)


def write_kv(
    g: PoolGroup, layer: int, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's new K/V into their pages (one indexed copy each for K and V); the layer's pages back,
    [pages, kv_heads, page_tokens, head_dim] each."""
    for kv in g.pending:
        kv.layer_ready(layer)  # a restored layer must have arrived (and a shift moved it) before we write
    k_pages, v_pages = g.pool.layer(layer)
    k_pages[g.write_pages, :, g.write_offsets] = key
    v_pages[g.write_pages, :, g.write_offsets] = value
    return k_pages, v_pages


def _per_job(
    plan: PackedPlan,
    g: PoolGroup,
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Each job attends on its own over a contiguous copy of its pages (no kernel here)."""
    out = query.new_empty(query.shape)
    row = 0
    for seg in g.segments:
        n, past = seg.n, seg.kv.length
        span = exact_attention.padded_keys(past + n)
        index = torch.tensor(seg.kv.pages[: seg.kv.pool.pages_for(span)], device=query.device)
        k, v = (_joined(pages.index_select(0, index), span) for pages in (k_pages, v_pages))
        q = query[row : row + n]
        if plan.batch_invariant and n == 1:
            bias = plan.exact_biases.get((-1, -1, past + 1))
            if bias is None:
                bias = plan.exact_biases[(-1, -1, past + 1)] = exact_attention.decode_bias(
                    [past + 1], span, query.device
                )
            o = exact_attention.decode_rows(q, k[None], v[None], bias, scaling)
        elif plan.batch_invariant:
            o = exact_attention.prefill_rows(q, k, v, past, scaling, plan.exact_biases)
        else:
            mask = torch.ones(n, past + n, dtype=torch.bool, device=query.device).tril(past)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k[None, :, : past + n],
                v[None, :, : past + n],
                attn_mask=mask,
                scale=scaling,
                enable_gqa=True,
            )[0].transpose(0, 1)
        out[row : row + n] = o
        row += n
    return out


def _joined(pages: torch.Tensor, span: int) -> torch.Tensor:
    """[n, heads, page_tokens, dim] pages as one [heads, span, dim] run of keys (a copy). A job's last
    page may end before `span` (pages smaller than KEY_BLOCK): the run is padded with zeros there, keys
    the mask hides, so the padded calls always see whole key blocks (exact_attention's rule)."""
    heads, dim = pages.shape[1], pages.shape[3]
    run = pages.transpose(0, 1).reshape(heads, -1, dim)
    if run.shape[1] < span:
        run = torch.cat((run, run.new_zeros(heads, span - run.shape[1], dim)), dim=1)
    return run[:, :span]


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
