"""Selective batching (Orca): one forward over the new tokens of every running job, attention per job.

The dense work of a step (embeddings, projections, MLP, norms, logits) runs once over all jobs' tokens
packed as one sequence: decoding is memory-bound, so reading the weights once for 8 jobs costs little
more than for one (FACTS.md, "Batching": 25/57/104 tok/s for 1/4/8 jobs). Attention is the one part that
differs per job: each job's queries attend to its own K/V, which lives in its own buffers (restored from
kvtier, adopted without a copy, saved on finish), so no two jobs ever see each other's tokens.

How it plugs into transformers without model-specific code: the model runs with an attention function
registered under `PACKED` (AttentionInterface), every token gets its own job's position (`position_ids`),
and the step's `PackedPlan` reaches the attention function as an extra forward keyword. Called without
a plan (plain `model.generate`, say), the function is ordinary SDPA with the SDPA mask, so switching a
model to it changes nothing for anyone else.
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
class PackedPlan:
    segments: list[Segment]
    _masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def mask(self, n: int, past: int, device: torch.device) -> torch.Tensor:
        """Causal mask of n new queries over past + n keys (query i sees keys up to past + i)."""
        key = (n, past)
        m = self._masks.get(key)
        if m is None:
            m = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)
            self._masks[key] = m
        return m


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
    heads, head_dim = query.shape[1], query.shape[-1]
    outs: list[torch.Tensor] = []
    for seg in plan.segments:
        s, n = seg.offset, seg.n
        past = seg.kv.length
        k, v = seg.kv.write(layer, key[:, :, s : s + n], value[:, :, s : s + n])
        q = query[:, :, s : s + n]
        if n == 1:
            # One query: fold the query heads that share a K/V head into the sequence axis, so SDPA runs
            # plain attention against the un-expanded K/V (no mask: the new token sees every key).
            kv_heads = k.shape[1]
            o = F.scaled_dot_product_attention(
                q.reshape(1, kv_heads, heads // kv_heads, head_dim), k, v, scale=scaling
            )
            outs.append(o.reshape(1, 1, heads, head_dim))
        else:
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if past == 0 else plan.mask(n, past, q.device),
                is_causal=past == 0,
                scale=scaling,
                enable_gqa=True,
            )
            outs.append(o.transpose(1, 2))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


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
