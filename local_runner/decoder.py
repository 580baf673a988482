"""The packed step's forward for Llama-family decoders, without transformers' per-module machinery.

Why: a decode step of a small model is a few hundred small operations. Measured on this 2-core CPU
(SmolLM2-135M, bfloat16, one job), the linear layers take ~43% of a transformers forward and the rest is
Python: module calls with their hooks, keyword plumbing and deprecation wrappers, mask construction, a
[batch, heads, tokens, head_dim] transpose per projection. vLLM and nano-vllm run models of their own for
the same reason. This module runs the same modules (the same weights, packed linears included, and the
same RMSNorm / rotary arithmetic, op for op) in a plain loop: [tokens, hidden] rows, no batch axis, no
mask (packed_attention masks per job), the final norm and the output head only over the rows whose
logits are wanted.

It reads the model's own submodules, so it serves any architecture whose decoder layer is Llama's
(Llama, Mistral, Qwen2: `input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj` with SiLU); `DecoderStack.of` says why not otherwise, and the step then runs
the transformers forward. The tests hold its logits to the transformers forward's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .dense import fuse
from .packed_attention import PackedPlan, attend

# One layer's attention: (q, k, v, layer index) -> [tokens, heads, head_dim].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

_LAYER_PARTS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (float32 statistics, the weight applied in the input dtype)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor of [tokens, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def fuse_projections(model: Any) -> int:
    """Fuse each Llama layer's q/k/v projections into `qkv_proj` and gate/up into `gate_up_proj` (one
    matrix product each instead of three and two: ~90 fewer calls per step for SmolLM2, and one rotary
    pass for q and k together). Call before packing. Returns the layers fused."""
    count = 0
    for layer in model.model.layers:
        qkv = fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        gate_up = fuse(layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj")
        count += qkv and gate_up
    return count


@dataclass
class _Layer:
    """One decoder layer's modules, looked up once (a linear may be packed or tiled: any callable;
    `qkv` and `gate_up` are the fused projections where fuse_projections made them, else None)."""

    attn: nn.Module  # the attention module itself: packed_attention reads its layer_idx
    norm1: torch.Tensor
    norm2: torch.Tensor
    eps1: float
    eps2: float
    q: Any
    k: Any
    v: Any
    o: Any
    gate: Any
    up: Any
    down: Any
    qkv: Any = None
    gate_up: Any = None


class DecoderStack:
    """The whole forward of a packed step: embeddings, every decoder layer, the final norm, the head."""

    def __init__(self, model: Any) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm.weight
        self.norm_eps = float(inner.norm.variance_epsilon)
        self.head = model.lm_head
        cfg = model.config
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.layers = [
            _Layer(
                attn=layer.self_attn,
                norm1=layer.input_layernorm.weight,
                norm2=layer.post_attention_layernorm.weight,
                eps1=float(layer.input_layernorm.variance_epsilon),
                eps2=float(layer.post_attention_layernorm.variance_epsilon),
                q=layer.self_attn.q_proj,
                k=layer.self_attn.k_proj,
                v=layer.self_attn.v_proj,
                o=layer.self_attn.o_proj,
                gate=layer.mlp.gate_proj,
                up=layer.mlp.up_proj,
                down=layer.mlp.down_proj,
                qkv=getattr(layer.self_attn, "qkv_proj", None),
                gate_up=getattr(layer.mlp, "gate_up_proj", None),
            )
            for layer in inner.layers
        ]
        self.scaling = float(inner.layers[0].self_attn.scaling)
        # The eager forward's norms, rotary and SiLU as exact_elementwise.cpp's fused operators (the exact
        # step where the kernel is built: use_fused_elementwise); torch's operations otherwise.
        self.fused = False

    def use_fused_elementwise(self) -> bool:
        """Run the eager forward's elementwise work on the fused operators (exact_kernel built): the
        same roundings as torch's operations, the same bits for a row in any batch, 4 calls per layer
        instead of ~25. Only where every layer has the fused projections and a head size the rotary
        operator takes. Returns whether it is on."""
        self.fused = self.head_dim % 16 == 0 and all(
            layer.qkv is not None and layer.gate_up is not None for layer in self.layers
        )
        return self.fused

    @staticmethod
    def unfit(model: Any) -> str | None:
        """None when `model` has Llama's decoder layer (this stack computes what its forward does), else
        why not."""
        inner: Any = getattr(model, "model", None)
        for part in ("embed_tokens", "rotary_emb", "norm", "layers"):
            if not hasattr(inner, part):
                return f"no model.{part}"
        if not hasattr(model, "lm_head"):
            return "no lm_head"
        if getattr(model.config, "hidden_act", "") != "silu":
            return f"activation {getattr(model.config, 'hidden_act', '?')!r} (SiLU expected)"
        for layer in inner.layers:
            for path in _LAYER_PARTS:
                obj: Any = layer
                for name in path.split("."):
                    obj = getattr(obj, name, None)
                if obj is None:
                    return f"a decoder layer has no {path}"
            extra = set(dict(layer.self_attn.named_children())) - {
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "qkv_proj",
            }
            if extra:
                return f"its attention has more than Llama's projections ({', '.join(sorted(extra))})"
        return None

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, plan: PackedPlan
    ) -> torch.Tensor:
        """Logits [len(keep), vocab] of the rows `keep` of the packed sequence `ids` (1-D, each token at
        its own position), eagerly."""

        def attend_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            return attend(plan, layer, q, k, v, self.scaling)

        if self.fused:
            return self._run_fused(ids, positions, keep, attend_layer)
        return self.run(ids, positions, keep, attend_layer)

    def _run_fused(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """`run` on exact_elementwise.cpp's operators: each residual add fused with the norm after it,
        q and k rotated in place in the fused projection's output, SiLU and the product in one pass."""
        ops = torch.ops.attnstore
        x = self.embed(ids)
        tokens = x.shape[0]
        cos, sin = self.rotary(x[None], positions[None])
        cos, sin = cos[0], sin[0]  # [tokens, head_dim]
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        layers = self.layers
        h = ops.rms_norm(x, layers[0].norm1, layers[0].eps1)
        for index, layer in enumerate(layers):
            qkv = layer.qkv(h).view(tokens, heads + 2 * kv_heads, head_dim)
            ops.rotary_(qkv, cos, sin, heads + kv_heads)
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
            attn = attend(q, k, v, index)
            h = ops.add_rms_norm_(x, layer.o(attn.reshape(tokens, -1)), layer.norm2, layer.eps2)
            down = layer.down(ops.silu_mul(layer.gate_up(h)))
            if index + 1 < len(layers):
                h = ops.add_rms_norm_(x, down, layers[index + 1].norm1, layers[index + 1].eps1)
            else:
                x.add_(down)
        return self.head(ops.rms_norm(x[keep], self.norm, self.norm_eps))

    def run(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """The forward with attention left to `attend` (eager: packed_attention with the step's plan;
        compiled.py: an opaque op, so that torch.compile traces everything else)."""
        x = self.embed(ids)
        tokens = x.shape[0]
        cos, sin = self.rotary(x[None], positions[None])
        cos, sin = cos[0, :, None], sin[0, :, None]  # [tokens, 1, head_dim]: broadcast over heads
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        for index, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.norm1, layer.eps1)
            if layer.qkv is not None:
                qkv = layer.qkv(h).view(tokens, heads + 2 * kv_heads, head_dim)
                qk = _rotate(qkv[:, : heads + kv_heads], cos, sin)  # elementwise: as q and k apart
                q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
            else:
                q = _rotate(layer.q(h).view(tokens, heads, head_dim), cos, sin)
                k = _rotate(layer.k(h).view(tokens, kv_heads, head_dim), cos, sin)
                v = layer.v(h).view(tokens, kv_heads, head_dim)
            attn = attend(q, k, v, index)
            x = x + layer.o(attn.reshape(tokens, -1))
            h = _rms_norm(x, layer.norm2, layer.eps2)
            if layer.gate_up is not None:
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
            else:
                gate, up = layer.gate(h), layer.up(h)
            x = x + layer.down(F.silu(gate) * up)
        return self.head(_rms_norm(x[keep], self.norm, self.norm_eps))
