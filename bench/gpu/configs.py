"""The kernel configs a device session compares: the engine's first, then the alternatives timed by
bench/gpu/kernels.py and compiled by bench/gpu/triton_aot.py (one config serves every launch of a
process: triton_attention.AttentionConfig)."""

from __future__ import annotations

import torch

from local_runner import triton_attention as ta
from local_runner import triton_ops

_ATTENTION_ALTERNATIVES = (
    ta.AttentionConfig(num_stages=3),
    ta.AttentionConfig(num_warps=8),
    ta.AttentionConfig(block_m=128, num_warps=8),
    ta.AttentionConfig(block_n=32),
    ta.AttentionConfig(block_m=128, block_n=32, num_warps=8, num_stages=3),
    ta.AttentionConfig(block_n=16, num_warps=8),
)

LINEAR_CONFIGS = (
    triton_ops.ENGINE_LINEAR,
    triton_ops.LinearConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
    triton_ops.LinearConfig(block_n=128, num_stages=3),
    triton_ops.LinearConfig(block_k=128, num_stages=3),
    # narrower tiles: more programs for a decode step's few rows (N / 32 of them), less reuse at many
    triton_ops.LinearConfig(block_n=32, block_k=128, num_stages=4),
)


def attention_configs(dtype: torch.dtype) -> tuple[ta.AttentionConfig, ...]:
    """The engine's config for `dtype` first, then the others."""
    engine = ta.config_for(dtype)
    return (engine, *(c for c in _ATTENTION_ALTERNATIVES if c != engine))
