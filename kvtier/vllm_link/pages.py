"""Where a token's K and V sit in one layer of vLLM's paged KV cache, per attention backend.

vLLM 0.32 hands a connector each layer's cache as a [blocks, kv_heads, block_size, 2 * head_dim] tensor,
but the backends lay that memory out differently:

- CPU_ATTN splits each (block, head) into a key area and a value area of block_size * head_dim values
  each (`kv_cache.view(B, H, 2 * block_size, D).chunk(2, dim=2)` in vllm/v1/attention/backends/
  cpu_attn.py); its kernels store the value area token by token ([block_size, head_dim]) and, on the
  x86 vector ISAs, the key area dimension by dimension ([head_dim, block_size]). Which one a machine's
  kernel uses is found at start by writing known keys through it (setup.py), never assumed;
- FLASH_ATTN and TRITON_ATTN split the last dimension: a token's key is its row's first head_dim values,
  its value the rest (`kv_cache.transpose(1, 2).split(head_size, dim=-1)`).

`PagedLayer` hides that: `scatter` writes tokens' K and V (as the store keeps them, [heads, tokens,
head_dim]) into their (block, offset) slots, `gather` reads them back. Any other backend is refused at
start with its name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

ROWS_SPLIT = frozenset({"CPU_ATTN"})  # keys then values along the token rows of a block
LAST_DIM_SPLIT = frozenset({"FLASH_ATTN", "TRITON_ATTN"})  # key | value along a token's row
SUPPORTED_BACKENDS = ROWS_SPLIT | LAST_DIM_SPLIT


class PagedLayer:
    """One attention layer's paged cache, addressed by token slot."""

    def __init__(
        self,
        cache: torch.Tensor,
        backend: str,
        num_kv_heads: int,
        head_dim: int,
        *,
        keys_transposed: bool = False,
    ) -> None:
        """`keys_transposed` (CPU_ATTN only): the kernel stores a block's keys as [head_dim, block_size]."""
        if backend not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"AttnStoreConnector does not know the {backend} KV layout; use one of "
                f"{', '.join(sorted(SUPPORTED_BACKENDS))} (vLLM's --attention-backend)"
            )
        if cache.dim() != 4 or cache.shape[1] != num_kv_heads or cache.shape[3] != 2 * head_dim:
            raise ValueError(
                f"paged KV cache of shape {tuple(cache.shape)} is not [blocks, {num_kv_heads}, block_size, "
                f"{2 * head_dim}]"
            )
        blocks, heads, block_size, _ = cache.shape
        self.block_size = int(block_size)
        self.device = cache.device
        self.dtype = cache.dtype
        # Both as [heads, blocks, block_size, head_dim] views (strided where the memory is not so ordered),
        # so that indexing blocks and offsets together reads and writes [heads, tokens, head_dim]: the
        # store's own order.
        if backend in ROWS_SPLIT:
            # .view raises if the memory is not laid out so.
            areas = cache.view(blocks, heads, 2, block_size * head_dim)
            if keys_transposed:
                self._k = areas[:, :, 0].view(blocks, heads, head_dim, block_size).permute(1, 0, 3, 2)
            else:
                self._k = areas[:, :, 0].view(blocks, heads, block_size, head_dim).transpose(0, 1)
            self._v = areas[:, :, 1].view(blocks, heads, block_size, head_dim).transpose(0, 1)
        else:
            self._k = cache[..., :head_dim].transpose(0, 1)
            self._v = cache[..., head_dim:].transpose(0, 1)

    def slots(self, block_ids: Sequence[int], offsets: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Index tensors for `scatter` / `gather`, on the cache's device."""
        as_tensor = torch.as_tensor
        return (
            as_tensor(block_ids, dtype=torch.long, device=self.device),
            as_tensor(offsets, dtype=torch.long, device=self.device),
        )

    def scatter(self, slots: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V, each [heads, tokens, head_dim] (one token per slot), into their slots."""
        blocks, offsets = slots
        self._k[:, blocks, offsets] = k.to(self.dtype)
        self._v[:, blocks, offsets] = v.to(self.dtype)

    def gather(self, slots: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the tokens in these slots, each a new [heads, tokens, head_dim] tensor."""
        blocks, offsets = slots
        return self._k[:, blocks, offsets], self._v[:, blocks, offsets]


WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""(key [tokens, heads, head_dim], value, cache [blocks, heads, block_size, 2 * head_dim], slot_mapping):
the attention backend's own kernel writing tokens into a cache."""


def find_cpu_key_layout(
    write: WriteKV, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> bool:
    """Whether this machine's CPU_ATTN kernel stores keys transposed: write a block of known K and V
    through it into a scratch cache and see which layout reads them back. Neither: refuse to start."""
    shape = (block_size, num_kv_heads, head_dim)
    key, value = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    cache = torch.zeros(1, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    write(key, value, cache, torch.arange(block_size))
    offsets = list(range(block_size))
    for transposed in (False, True):
        layer = PagedLayer(cache, "CPU_ATTN", num_kv_heads, head_dim, keys_transposed=transposed)
        k, v = layer.gather(layer.slots([0] * block_size, offsets))
        if torch.equal(k, key.transpose(0, 1)) and torch.equal(v, value.transpose(0, 1)):
            return transposed
    raise ValueError("the CPU attention kernel stores KV in a layout AttnStoreConnector does not know")
