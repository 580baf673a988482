"""Moving stored keys to other positions: a RoPE rotation by delta positions, on plain tensors.

A key that RoPE put at position p is R(p)·k (times a constant attention scaling for yarn). Rotations
compose, R(d)·R(p) = R(p + d), so a stored key moves to position p + d by one more rotation by the angle
d·inv_freq, and the scaling, applied once already, stays as it is: the result equals the key computed at
p + d up to float rounding (docs/decoupling.md). Values carry no position and never move.

Only what the rotation needs lives here (inv_freq, how many dims rotate, how they pair up); reading those
from a model is rope_config.py's job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeShift:
    """One model's RoPE, enough to move its keys.

    `inv_freq`: the per-pair frequencies ([rotary_dim // 2]) as the model's rotary module holds them (after
    linear / llama3 / yarn scaling). `interleaved`: pairs are dims (2i, 2i+1) (GLM, Cohere, GPT-J);
    otherwise (i, i + rotary_dim/2), transformers' rotate_half (Llama, Qwen2, Mistral). Dims from
    rotary_dim on (partial rotary) pass through unchanged."""

    inv_freq: torch.Tensor
    interleaved: bool = False

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.numel())

    def rotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """`keys` ([..., tokens, head_dim], any float dtype) moved by `delta` positions (negative: towards
        the start), as a new tensor of the same dtype. The angle is computed in float64 so the shift adds
        no rounding of its own beyond the final cast."""
        if delta == 0:
            return keys.clone()
        return self._rotated(keys.to(torch.float32), delta).to(keys.dtype)

    def matrix(self, delta: int, head_dim: int) -> torch.Tensor:
        """The move by `delta` positions as one float32 matrix M ([head_dim, head_dim]): a key row k
        moved is k @ M (the rotation's cos and sin in their places, 1 for dims that do not rotate). One
        matrix serves every layer and head of a turn, and moving a layer's keys is one product
        (`move_into`) where `rotate` makes a dozen passes over them: each pass is a parallel region,
        and on a small, busy CPU every region may wait for a core (docs/benchmarks.md, "Positional
        decoupling")."""
        eye = torch.eye(head_dim, dtype=torch.float64)
        return self._rotated(eye, delta).to(torch.float32)  # row j: the unit vector j moved

    @staticmethod
    def move_into(source: torch.Tensor, target: torch.Tensor, matrix: torch.Tensor) -> None:
        """target <- source moved by `matrix` (self.matrix): both [..., tokens, head_dim] of one dtype,
        and they may overlap (the rows are read into float32 before anything is written)."""
        rows = source.to(torch.float32).reshape(-1, source.shape[-1])
        target.copy_(torch.mm(rows, matrix).view(target.shape))

    def _rotated(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """Rows of `x` (a float tensor) rotated by `delta` positions, in x's dtype."""
        d = self.rotary_dim
        if d > x.shape[-1]:
            raise ValueError(f"rotary dim {d} exceeds the head dim {x.shape[-1]}")
        angle = float(delta) * self.inv_freq.detach().to("cpu", torch.float64)
        cos = angle.cos().to(x.device, x.dtype)
        sin = angle.sin().to(x.device, x.dtype)
        rot, rest = x[..., :d], x[..., d:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        out = torch.stack((y1, y2), dim=-1).flatten(-2) if self.interleaved else torch.cat((y1, y2), dim=-1)
        if rest.shape[-1]:
            out = torch.cat((out, rest), dim=-1)
        return out
