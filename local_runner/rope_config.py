"""A served model's RoPE as rope_shift.RopeShift, or why its stored keys cannot be moved exactly.

Read from the model itself, not re-derived from its config: transformers' rotary module holds the
`inv_freq` its forward uses (after linear, llama3 or yarn scaling, for partial rotary only the rotated
dims) and names its `rope_type`. A shift is exact only when those frequencies are fixed; dynamic NTK and
longrope change them with the sequence length, and models without RoPE (ALiBi, learned positions) have
nothing to rotate: for those the runner recomputes after a truncation.
"""

from __future__ import annotations

from typing import Any

import torch

from .rope_shift import RopeShift

# rope types whose frequencies do not depend on the sequence length (yarn's attention scaling is a
# constant factor already in the stored keys: a rotation leaves it as it is).
SHIFTABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})

# Model families whose attention applies RoPE to the keys before they are cached, in these layouts.
ROTATE_HALF_MODELS = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "stablelm", "phi", "phi3", "olmo", "olmo2", "granite", "gemma"}
)
INTERLEAVED_MODELS = frozenset({"glm", "glm4", "cohere"})


def rope_shift_for(model: Any) -> RopeShift | str:
    """The model's RopeShift, or a one-line reason why its keys cannot be shifted exactly."""
    config = model.config
    model_type = getattr(config, "model_type", "")
    if model_type not in ROTATE_HALF_MODELS | INTERLEAVED_MODELS:
        return f"model type {model_type!r}: its positional encoding is not known to be a shiftable RoPE"
    rotary = _rotary_module(model)
    if rotary is None:
        return f"model type {model_type!r}: no rotary embedding module found"
    if not isinstance(getattr(rotary, "rope_type", "default"), str):  # per-layer-type RoPE (sliding/full)
        return f"model type {model_type!r}: RoPE differs per layer type"
    varying = varying_rope(model)
    if varying is not None:
        return varying
    inv_freq = getattr(rotary, "original_inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        inv_freq = rotary.inv_freq
    assert isinstance(inv_freq, torch.Tensor)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if 2 * inv_freq.numel() > head_dim:
        return f"rotary dim {2 * inv_freq.numel()} exceeds the head dim {head_dim}"
    return RopeShift(inv_freq.detach().to("cpu", torch.float32).clone(), model_type in INTERLEAVED_MODELS)


def varying_rope(model: Any) -> str | None:
    """Why the model's RoPE frequencies depend on the sequence length (dynamic NTK, longrope: transformers
    scales them by the largest position of the call), or None where they are fixed or there is no RoPE.
    A packed step puts many jobs' positions in one call, and the CUDA forward computes its rotary cache
    once for every position: either would rotate a job's keys by what the other jobs' lengths say."""
    rotary = _rotary_module(model)
    rope_type = getattr(rotary, "rope_type", "default") if rotary is not None else "default"
    if isinstance(rope_type, str) and rope_type not in SHIFTABLE_ROPE_TYPES:
        return f"rope type {rope_type!r} changes its frequencies with the sequence length"
    return None


def _rotary_module(model: Any) -> Any:
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            return module
    return None
