"""The shape of one model's KV cache, and helpers to bring caller tensors into that shape.

Kept separate so that keys, disk files and tiers agree on one description of "what a token costs".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class KVLayout:
    """Per-token KV geometry of a model: what every stored chunk must match."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"KVLayout dimensions must be positive: {self}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"unsupported KV dtype {self.dtype}; use one of {list(DTYPES_BY_NAME)}")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    def describe(self) -> str:
        """A stable string naming the layout; part of every key and file header."""
        return f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-{self.dtype_name}"


def as_heads_tokens_dim(t: torch.Tensor, layout: KVLayout, min_tokens: int) -> torch.Tensor:
    """Return `t` as [heads, tokens, head_dim] (accepting a leading batch of 1), validated against layout."""
    if t.dim() == 4:
        if t.shape[0] != 1:
            raise ValueError(f"KV batch size must be 1, got shape {tuple(t.shape)}")
        t = t[0]
    if t.dim() != 3 or t.shape[0] != layout.num_kv_heads or t.shape[2] != layout.head_dim:
        raise ValueError(
            f"KV tensor shape {tuple(t.shape)} does not match [1, {layout.num_kv_heads}, T, {layout.head_dim}]"
        )
    if t.shape[1] < min_tokens:
        raise ValueError(f"KV tensor holds {t.shape[1]} tokens, fewer than the {min_tokens} token ids given")
    if t.dtype != layout.dtype:
        raise ValueError(f"KV dtype {t.dtype} does not match the store's {layout.dtype}")
    return t


def normalize_layers(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout, n_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validate a caller's per-layer (K, V) pairs and view them as [heads, tokens, head_dim]."""
    if len(layers) != layout.num_layers:
        raise ValueError(f"got {len(layers)} layers, layout has {layout.num_layers}")
    return [
        (as_heads_tokens_dim(k, layout, n_tokens), as_heads_tokens_dim(v, layout, n_tokens))
        for k, v in layers
    ]
