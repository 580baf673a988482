"""A backend's page map, found at start through its own write kernel, never assumed.

Two candidates, each accepted only after a round trip through the kernel:

1. vLLM's own description of a page: a logical [blocks, heads, tokens, 2 * head_dim] cache, keys then
   values along the last axis (the tensor's strides give the physical order). FLASH_ATTN, FLASHINFER and
   TRITON_ATTN write so (`kv_cache.transpose(1, 2).split(head_size, dim=-1)` in their
   do_kv_cache_update).
2. What the kernel reveals: every element of K and V written as its own index into a scratch cache shaped
   and ordered like the real one, in digits small enough to be exact in the cache's dtype (256 in
   bfloat16: one write per digit); where an index lands is where that element lives. CPU_ATTN's
   per-ISA packings (keys by dimension on AVX-512 and AVX2, 16-token tiles and bfloat16 pairs on AMX)
   are found so, and so would be any other permutation of a block.

The round trip: random K and V for a shuffled subset of a scratch cache's slots, written once by the
kernel and once by `PagedLayer.scatter` through the map (on each path it may take), must leave identical
bytes, and `gather` must read the kernel's writing back. A map that neither candidate passes is refused,
with the backend, dtype and ISA named by the caller.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .pages import KV, PagedLayer, PageGeometry, PageMap

WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""(key [tokens, heads, head_dim], value, cache shaped like vLLM's, slot_mapping): the attention
backend's own kernel writing tokens into a cache."""

SENTINEL = -1.0  # what an element the kernel did not write reads as (tags are >= 0)


class LayoutError(ValueError):
    """A KV layout AttnStoreConnector cannot map: vLLM refuses to start with it."""


def find_page_map(write: WriteKV, like: torch.Tensor, geometry: PageGeometry, what: str) -> PageMap:
    """The page map of caches like `like` written by `write`; `what` names the backend, dtype and ISA."""
    candidates: list[tuple[str, Callable[[], PageMap]]] = [
        ("vLLM's page description", lambda: described_map(like, geometry)),
        ("the kernel's own layout", lambda: tagged_map(write, like, geometry)),
    ]
    reasons = []
    for name, build in candidates:
        try:
            page_map = build()
            check_round_trip(write, like, page_map)
            return page_map
        except LayoutError as exc:
            reasons.append(f"{name}: {exc}")
    raise LayoutError(
        f"{what} stores KV in a layout AttnStoreConnector cannot map ({'; '.join(reasons)}); "
        "choose another --attention-backend or --dtype"
    )


def scratch_like(like: torch.Tensor, block_dim: int, num_blocks: int) -> torch.Tensor:
    """A compact cache of `num_blocks` blocks whose axes lie in memory in the order `like`'s do."""
    order = sorted(range(like.dim()), key=lambda i: like.stride(i), reverse=True)  # outermost first
    sizes = [num_blocks if i == block_dim else like.shape[i] for i in order]
    memory = torch.empty(sizes, dtype=like.dtype, device=like.device)
    return memory.permute([order.index(i) for i in range(like.dim())])


def described_map(like: torch.Tensor, geometry: PageGeometry) -> PageMap:
    """vLLM's page description: keys then values along the last axis of [blocks, heads, tokens, 2 * dim]."""
    g = geometry
    page = (g.num_kv_heads, g.block_size, 2 * g.head_dim)
    if like.dim() != 4 or tuple(like.shape[1:]) != page or g.block_dim != 0:
        raise LayoutError(f"the cache is {tuple(like.shape)}, not [blocks, {', '.join(map(str, page))}]")
    kv, h, t, d = torch.meshgrid(
        *(torch.arange(n) for n in (KV, g.num_kv_heads, g.block_size, g.head_dim)), indexing="ij"
    )
    return PageMap(torch.stack((torch.zeros_like(h), h, t, kv * g.head_dim + d), -1), g, "vLLM's page")


def exact_integers(dtype: torch.dtype) -> int:
    """How many consecutive integers from 0 the dtype holds exactly (256 in bfloat16), at most 2**24."""
    return min(2 * round(1 / torch.finfo(dtype).eps), 2**24)


def tagged_map(write: WriteKV, like: torch.Tensor, geometry: PageGeometry) -> PageMap:
    """The kernel's own layout: each element written as its index, found where it lands."""
    g = geometry
    if not like.dtype.is_floating_point:
        raise LayoutError(f"a {like.dtype} cache holds no values the connector can tag")
    num_blocks = 2  # block 1 shows which axis counts blocks and that blocks are laid out alike
    scratch = scratch_like(like, g.block_dim, num_blocks)
    tokens = num_blocks * g.block_size
    per_kv = tokens * g.num_kv_heads * g.head_dim
    tags = torch.arange(KV * per_kv, device=like.device)
    base, passes = exact_integers(like.dtype), 1
    while base**passes < tags.numel():
        passes += 1
    found = torch.zeros(scratch.numel(), dtype=torch.long, device=like.device)
    written: torch.Tensor | None = None
    slot_mapping = torch.arange(tokens, device=like.device)
    for p in range(passes):
        digits = ((tags // base**p) % base).to(like.dtype).view(KV, tokens, g.num_kv_heads, g.head_dim)
        scratch.fill_(SENTINEL)
        _write(write, digits[0], digits[1], scratch, slot_mapping)
        got = scratch.reshape(-1).to(torch.float64)  # in logical order
        here = got != SENTINEL
        if written is not None and not torch.equal(here, written):
            raise LayoutError("the kernel writes different elements for different values")
        written, values = here, got[here]
        if bool(((values != values.round()) | (values < 0) | (values >= base)).any()):
            raise LayoutError("the kernel does not store values as given (scaled or converted)")
        found[here] += values.long() * base**p
    assert written is not None
    positions = written.nonzero().squeeze(1)
    stored = found[positions]
    once = int((torch.bincount(stored, minlength=tags.numel())[: tags.numel()] == 1).sum())
    if positions.numel() != tags.numel() or once != tags.numel():
        raise LayoutError(f"{tags.numel() - once} of {tags.numel()} K and V elements not stored once each")
    where = torch.empty_like(tags)
    where[stored] = positions
    coords = _unravel(where, tuple(scratch.shape)).view(
        KV, num_blocks, g.block_size, g.num_kv_heads, g.head_dim, scratch.dim()
    )
    blocks = torch.arange(num_blocks, device=like.device).view(1, num_blocks, 1, 1, 1)
    if not torch.equal(coords[..., g.block_dim], blocks.expand(coords.shape[:-1])):
        raise LayoutError(f"tokens land outside their slot's block (axis {g.block_dim} of the cache)")
    coords[..., g.block_dim] = 0
    if not all(torch.equal(coords[:, b], coords[:, 0]) for b in range(1, num_blocks)):
        raise LayoutError("the kernel lays blocks out differently")
    return PageMap(coords[:, 0].permute(0, 2, 1, 3, 4), g, "found through the kernel")


def _unravel(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Logical flat positions -> [n, len(shape)] indices (torch.unravel_index, on any device)."""
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat = flat // size
    return torch.stack(coords[::-1], -1)


def check_round_trip(write: WriteKV, like: torch.Tensor, page_map: PageMap, seed: int = 0) -> None:
    """Random K and V written by the kernel and by the map's scatter must leave the same bytes, and
    gather must read the kernel's writing back: on each path (strided, indexed) a layer may take."""
    g = page_map.geometry
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 3
    kernel = scratch_like(like, g.block_dim, num_blocks)
    before = torch.randn(kernel.shape, generator=gen).to(like.dtype)
    kernel.copy_(before)
    tokens = num_blocks * g.block_size
    slots = torch.randperm(tokens, generator=gen)[: max(1, tokens - g.block_size // 2)]
    shape = (len(slots), g.num_kv_heads, g.head_dim)
    key, value = (torch.randn(shape, generator=gen).to(like.dtype) for _ in range(KV))
    slots, key, value = slots.to(like.device), key.to(like.device), value.to(like.device)
    _write(write, key, value, kernel, slots)
    key, value = key.transpose(0, 1), value.transpose(0, 1)  # the store's [heads, tokens, dims]
    strided_too = any(form is not None for form in page_map.addressing(kernel).strided)
    for strided in (True, False) if strided_too else (False,):
        mine = scratch_like(like, g.block_dim, num_blocks)
        mine.copy_(before)
        layer = PagedLayer(mine, page_map, strided=strided)
        at = layer.slots((slots // g.block_size).tolist(), (slots % g.block_size).tolist())
        layer.scatter(at, key, value)
        if not torch.equal(_bytes(mine), _bytes(kernel)):
            differ = int((mine != kernel).sum())
            raise LayoutError(f"{differ} elements differ from the kernel's writing ({layer.path} path)")
        k, v = PagedLayer(kernel, page_map, strided=strided).gather(at)
        if not (torch.equal(k, key) and torch.equal(v, value)):
            raise LayoutError(f"gathering does not read back the kernel's writing ({layer.path} path)")


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.contiguous().view(torch.uint8)


def _write(
    write: WriteKV, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
) -> None:
    try:
        write(key, value, cache, slots)
    except Exception as exc:  # a kernel that cannot write a cache like this one: refused, with its words
        raise LayoutError(f"the kernel failed on a scratch cache: {type(exc).__name__}: {exc}") from exc
