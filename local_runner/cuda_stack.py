"""The packed step's forward on CUDA, for Llama-family decoders (decoder.py's contract): every token of a
step in one sequence, the norms, rotary and SiLU fused (triton_ops.py), attention over the jobs' pages
(triton_attention.py through packed_attention.attend), the linear layers by cuBLAS or, with
`batch_invariant`, by triton_ops.linear (one tile shape for every row count).

Why not decoder.py's loop: on a GPU the step is bound by kernel launches and their Python, not by
arithmetic (an eager step of an 8B model took ten times the read of its weights): this forward launches
about ten kernels a layer, and decode steps replay it as a CUDA graph (cuda_graphs.py), so a decoding
token costs the weights' read and little else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import triton_attention, triton_ops
from .packed_attention import PackedPlan, attend

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Layer:
    norm1: torch.Tensor
    eps1: float
    norm2: torch.Tensor
    eps2: float
    qkv: torch.Tensor  # [heads * dim + 2 * kv_heads * dim, hidden]
    o: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


def _heads(cfg: Any) -> tuple[int, int, int]:
    """The model's query heads, K/V heads and head size."""
    heads = int(cfg.num_attention_heads)
    return (
        heads,
        int(cfg.num_key_value_heads),
        int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
    )


class CudaStack:
    """The whole forward of a packed step on CUDA (the weights are the model's own tensors: no copy)."""

    def __init__(
        self,
        model: Any,
        *,
        invariant: bool,
        max_positions: int,
        attention: triton_attention.AttentionConfig | None = None,
        linear: triton_ops.LinearConfig | None = None,
    ) -> None:
        """`attention`, `linear`: the configs every launch of this model takes (kernel_choice.py: measured
        on the device); the engine's defaults where None."""
        inner = model.model
        self.heads, self.kv_heads, self.head_dim = _heads(model.config)
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.norm_eps = float(inner.norm.variance_epsilon)
        self.head = model.lm_head.weight
        self.scaling = float(inner.layers[0].self_attn.scaling)
        self.layers = [_layer(layer) for layer in inner.layers]
        self.invariant = invariant
        self.attention = attention or triton_attention.config_for(self.embed.dtype)
        self.linear_config = linear or triton_ops.ENGINE_LINEAR
        self._linear: Linear = (
            functools.partial(triton_ops.linear, config=self.linear_config) if invariant else _cublas
        )
        # The rotary cache of every position a job may reach, as the model's rotary module computes it.
        positions = torch.arange(max_positions, device=self.embed.device)
        probe = torch.zeros(1, dtype=self.embed.dtype, device=self.embed.device)
        with torch.inference_mode():
            cos, sin = inner.rotary_emb(probe, positions[None])
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()

    @staticmethod
    def unfit(model: Any) -> str | None:
        """None when every layer has the fused projections this forward reads and the paged kernel takes
        its heads (the decode graphs call it directly), else why not."""
        heads, kv_heads, head_dim = _heads(model.config)
        if not triton_attention.takes(head_dim, heads // kv_heads):
            return f"the paged kernel takes heads of 16-256 dims, at most {triton_attention.BLOCK_M} per K/V head"
        for layer in model.model.layers:
            if (
                getattr(layer.self_attn, "qkv_proj", None) is None
                or getattr(layer.mlp, "gate_up_proj", None) is None
            ):
                return "the layers' q/k/v or gate/up projections are not fused"
            if getattr(layer.self_attn.qkv_proj, "bias", None) is not None:
                return "projections with a bias"
        return None

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, plan: PackedPlan
    ) -> torch.Tensor:
        """Logits [len(keep), vocab] of the rows `keep` of the packed sequence `ids`."""
        linear = self._linear
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)
        tokens = x.shape[0]
        layers = self.layers
        h = triton_ops.rms_norm(x, layers[0].norm1, layers[0].eps1)
        for index, layer in enumerate(layers):
            qkv = linear(h, layer.qkv).view(tokens, heads + 2 * kv_heads, dim)
            triton_ops.rotary_(qkv, self.cos, self.sin, positions, heads + kv_heads)
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
            attn = attend(plan, index, q, k, v, self.scaling)
            h = triton_ops.add_rms_norm_(
                x, linear(attn.reshape(tokens, -1), layer.o), layer.norm2, layer.eps2
            )
            down = linear(triton_ops.silu_mul(linear(h, layer.gate_up)), layer.down)
            if index + 1 < len(layers):
                nxt = layers[index + 1]
                h = triton_ops.add_rms_norm_(x, down, nxt.norm1, nxt.eps1)
            else:
                x = x + down
        last = triton_ops.rms_norm(x.index_select(0, keep), self.norm, self.norm_eps)
        return linear(last, self.head)


def layer_products(model: Any) -> list[torch.Tensor]:
    """The first layer's four product weights [N, K] (q/k/v, o, gate/up, down), as this forward reads
    them: what the invariant product's config is timed on (kernel_choice.py)."""
    layer = _layer(model.model.layers[0])
    return [layer.qkv, layer.o, layer.gate_up, layer.down]


def _cublas(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def _layer(layer: Any) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    return _Layer(
        norm1=layer.input_layernorm.weight,
        eps1=float(layer.input_layernorm.variance_epsilon),
        norm2=layer.post_attention_layernorm.weight,
        eps2=float(layer.post_attention_layernorm.variance_epsilon),
        qkv=attn.qkv_proj.weight,
        o=attn.o_proj.weight,
        gate_up=mlp.gate_up_proj.weight,
        down=mlp.down_proj.weight,
    )
