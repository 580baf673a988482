"""Synthetic attention kernels writing K and V into paged caches the way vLLM's backends do (and a few
that no page map explains), for the layout tests: plain tensors, no vLLM, no GPU.

Each is a `WriteKV`: (key [tokens, heads, dim], value, cache, slot_mapping) -> None, slot s being token
s % block_size of block s // block_size; the caches are vLLM 0.32's logical [blocks, heads, tokens,
2 * dim] (any strides) unless a kernel says otherwise.
"""

from __future__ import annotations

import torch

from vllm_engine.link.discover import WriteKV


def _each_slot(slots: torch.Tensor, block_size: int) -> list[tuple[int, int, int]]:
    return [(i, s // block_size, s % block_size) for i, s in enumerate(slots.tolist())]


def vllm_page(key, value, cache, slots) -> None:
    """FLASH_ATTN / FLASHINFER / TRITON_ATTN: [blocks, heads, tokens, 2 * dim], K then V on the last axis."""
    k_cache, v_cache = cache.transpose(1, 2).split(key.shape[-1], dim=-1)
    for i, b, t in _each_slot(slots, cache.shape[2]):
        k_cache[b, t], v_cache[b, t] = key[i], value[i]


def _areas(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU_ATTN's split of each (block, head): a key area, then a value area, of tokens * dim each."""
    b, h, n, d2 = cache.shape
    areas = cache.view(b, h, 2, n * (d2 // 2))
    return areas[:, :, 0], areas[:, :, 1]


def cpu_keys_by_token(key, value, cache, slots) -> None:
    """CPU_ATTN with keys as [tokens, dim] (as its values are)."""
    n, d = cache.shape[2], key.shape[-1]
    k_area, v_area = (a.unflatten(-1, (n, d)) for a in _areas(cache))
    for i, b, t in _each_slot(slots, n):
        k_area[b, :, t], v_area[b, :, t] = key[i], value[i]


def cpu_keys_by_dim(key, value, cache, slots) -> None:
    """CPU_ATTN on AVX-512 and AVX2 ("vec"): keys [dim, tokens], values [tokens, dim]."""
    n, d = cache.shape[2], key.shape[-1]
    k_area, v_area = _areas(cache)
    k_area, v_area = k_area.unflatten(-1, (d, n)), v_area.unflatten(-1, (n, d))
    for i, b, t in _each_slot(slots, n):
        k_area[b, :, :, t], v_area[b, :, t] = key[i], value[i]


def cpu_amx(key, value, cache, slots) -> None:
    """CPU_ATTN on AMX in 16-bit dtypes, as vLLM 0.32's kernel lays it out: keys in 16-token tiles of
    VNNI pairs along dim ([tokens/16, dim/2, 16, 2]), values in token pairs ([dim/16, tokens/2, 16, 2])."""
    n, d = cache.shape[2], key.shape[-1]
    k_area, v_area = _areas(cache)
    k_tiles = k_area.unflatten(-1, (n // 16, d // 2, 16, 2))
    v_pairs = v_area.unflatten(-1, (d // 16, n // 2, 16, 2))
    for i, b, t in _each_slot(slots, n):
        k_tiles[b, :, t // 16, :, t % 16, :] = key[i].unflatten(-1, (d // 2, 2))
        v_pairs[b, :, :, t // 2, :, t % 2] = value[i].unflatten(-1, (d // 16, 16))


def split_kv(key, value, cache, slots) -> None:
    """An older FLASH_ATTN cache: [2, blocks, tokens, heads, dim], the block axis second."""
    for i, b, t in _each_slot(slots, cache.shape[2]):
        cache[0, b, t], cache[1, b, t] = key[i], value[i]


def permuted(seed: int) -> WriteKV:
    """A kernel that stores a block's elements in an arbitrary (fixed) order: only indices explain it."""

    def write(key, value, cache, slots) -> None:
        b, h, n, d2 = cache.shape
        order = torch.randperm(h * n * d2, generator=torch.Generator().manual_seed(seed))
        logical = torch.arange(h * n * d2).view(2, h, n, d2 // 2)  # (K|V, head, token, dim) in a block
        flat = cache.view(b, -1)
        for i, blk, t in _each_slot(slots, n):
            places = order[logical[:, :, t].reshape(2, -1)]  # this token's K and V elements
            flat[blk, places[0]], flat[blk, places[1]] = key[i].reshape(-1), value[i].reshape(-1)

    return write


# ---- kernels no map explains -------------------------------------------------------------------


def scaling(key, value, cache, slots) -> None:
    """A kernel that stores what it is given times two (a quantizing kernel with a scale, say)."""
    cpu_keys_by_dim(key * 2, value * 2, cache, slots)


def dropping(key, value, cache, slots) -> None:
    """A kernel that stores only half of each key."""
    cpu_keys_by_dim(key, value, cache, slots)
    cache[..., : key.shape[-1] // 2] = -1


def garbage(key, value, cache, slots) -> None:
    cache.normal_()


def blocks_differ(key, value, cache, slots) -> None:
    """Even blocks by dim, odd blocks by token: no one map for every block."""
    even = torch.tensor([s for s in slots.tolist() if (s // cache.shape[2]) % 2 == 0])
    odd = torch.tensor([s for s in slots.tolist() if (s // cache.shape[2]) % 2 == 1])
    index = {s: i for i, s in enumerate(slots.tolist())}
    for part, fn in ((even, cpu_keys_by_dim), (odd, cpu_keys_by_token)):
        if part.numel():
            rows = torch.tensor([index[s] for s in part.tolist()])
            fn(key[rows], value[rows], cache, part)


def failing(key, value, cache, slots) -> None:
    raise RuntimeError("unsupported ISA for this cache")
