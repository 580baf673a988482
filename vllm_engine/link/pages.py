"""Where a token's K and V sit in one layer of vLLM's paged KV cache, and moving them in and out.

vLLM 0.32 hands a connector each layer's cache as a logical [blocks, kv_heads, block_size, 2 * head_dim]
tensor whose strides give the physical order of those four axes (vllm/v1/kv_cache_layout.py), but what a
backend's kernel does inside a block is its own business: CPU_ATTN splits each (block, head) into a key
and a value area and, depending on the ISA, stores keys token by token, dimension by dimension
(AVX-512, AVX2) or in AMX tiles of bfloat16 pairs; FLASH_ATTN, FLASHINFER and TRITON_ATTN keep vLLM's
described page (K then V along the last axis). So nothing here is written per backend:

- a `PageMap` says, for every element (K or V, head, token of a block, dim), its logical index in the
  cache tensor; discover.py finds it at start through the backend's own write kernel and checks it;
- `PagedLayer` turns that map and one layer's strides into addresses: `scatter` writes tokens' K and V
  (as the store keeps them, [heads, tokens, head_dim]) into their (block, offset) slots, `gather` reads
  them back, one indexing op each for K and for V.

Most maps are strided once the token and dim axes are split into (outer, inner) pairs (an AMX tile of 16
tokens, a VNNI pair of 2): those are moved through an `as_strided` view (the fast path); any other map
through flat element indices (the general path). Both give the same bytes; discover.py checks the one a
layer will use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

KV = 2  # the map's first axis: 0 keys, 1 values


@dataclass(frozen=True)
class PageGeometry:
    """What vLLM says about a layer's cache: the store's per-token shape, the tokens per block, and which
    axis of the cache tensor counts blocks (0 in vLLM 0.32's logical [blocks, heads, tokens, content])."""

    num_kv_heads: int
    head_dim: int
    block_size: int
    block_dim: int = 0


class PageMap:
    """Where each element of a block sits: `coords[kv, head, token, dim]` is its logical index into the
    cache tensor, with the block axis at 0. Independent of the number of blocks and of the strides, so one
    map found on a small scratch cache serves every layer of the real one."""

    def __init__(self, coords: torch.Tensor, geometry: PageGeometry, source: str) -> None:
        g = geometry
        expected = (KV, g.num_kv_heads, g.block_size, g.head_dim)
        if tuple(coords.shape[:4]) != expected or coords.dim() != 5:
            raise ValueError(f"a page map is {expected} x cache dims, not {tuple(coords.shape)}")
        if bool((coords[..., g.block_dim] != 0).any()):
            raise ValueError("a page map's block coordinate must be 0")
        self.coords = coords.to(torch.long).cpu()
        self.geometry = geometry
        self.source = source  # how it was found, for the start-up log
        self._addressing: dict[tuple[object, ...], Addressing] = {}

    def addressing(self, cache: torch.Tensor) -> Addressing:
        """The addresses for caches of this shape and these strides (shared by every such layer)."""
        key = (tuple(cache.shape), tuple(cache.stride()), cache.device)
        if key not in self._addressing:
            self._addressing[key] = Addressing(self, cache)
        return self._addressing[key]


class Strided(NamedTuple):
    """One of K or V as a strided view: the token and dim axes split into (size // inner, inner)."""

    token_inner: int
    dim_inner: int
    sizes: tuple[int, ...]  # without the blocks axis: heads, token axes, dim axes
    strides: tuple[int, ...]
    base: int  # element offset of (head 0, token 0, dim 0) in block 0


class Addressing:
    """Element offsets of one kind of layer (a shape and its strides), relative to its storage offset."""

    def __init__(self, page_map: PageMap, cache: torch.Tensor) -> None:
        g = page_map.geometry
        if cache.dim() != page_map.coords.shape[-1]:
            raise ValueError(
                f"a {cache.dim()}-dimensional cache for a {page_map.coords.shape[-1]}-d page map"
            )
        limits = torch.tensor(cache.shape)
        limits[g.block_dim] = 1
        if bool((page_map.coords >= limits).any()):
            raise ValueError(f"a page map beyond the cache's shape {tuple(cache.shape)}")
        if min(cache.stride()) < 0:
            raise ValueError("a cache with negative strides")
        strides = torch.tensor(cache.stride(), dtype=torch.long)
        offsets = (page_map.coords * strides).sum(-1)  # [2, heads, tokens, dims]
        self.geometry = g
        self.num_blocks = int(cache.shape[g.block_dim])
        self.block_stride = int(cache.stride(g.block_dim))
        self.span = 1 + sum((n - 1) * s for n, s in zip(cache.shape, cache.stride(), strict=True))
        self.strided = tuple(strided_form(offsets[kv]) for kv in range(KV))
        self.offsets = offsets.to(cache.device)


def _splits(n: int) -> list[int]:
    """Inner sizes to try for an axis of n: 1, then the powers of two dividing it."""
    return [1] + [s for s in (2**i for i in range(1, n.bit_length())) if n % s == 0]


def strided_form(offsets: torch.Tensor) -> Strided | None:
    """The strided view these [heads, tokens, dims] offsets are, if any (the first, fewest splits first)."""
    heads, tokens, dims = offsets.shape
    pairs = sorted(((q, p) for q in _splits(tokens) for p in _splits(dims)), key=lambda qp: qp[0] * qp[1])
    for q, p in pairs:
        sizes = (heads, *_axis(tokens, q), *_axis(dims, p))
        x = offsets.reshape(sizes)
        base = int(x.flatten()[0])
        steps = []
        for axis, size in enumerate(sizes):
            unit = [0] * len(sizes)
            unit[axis] = 1 if size > 1 else 0
            steps.append(int(x[tuple(unit)]) - base)
        if min(steps) < 0:
            continue
        rebuilt = torch.full(sizes, base, dtype=torch.long)
        for axis, (size, step) in enumerate(zip(sizes, steps, strict=True)):
            shape = [1] * len(sizes)
            shape[axis] = size
            rebuilt = rebuilt + torch.arange(size).view(shape) * step
        if torch.equal(rebuilt, x):
            return Strided(q, p, sizes, tuple(steps), base)
    return None


def _axis(n: int, inner: int) -> tuple[int, ...]:
    return (n // inner, inner) if inner > 1 else (n,)


WIDE = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size stand-ins for runs of elements


@dataclass
class Slots:
    """Tokens' (block, offset) slots, with the indices each kind of layer derives from them kept, so that
    the layers of one kind (usually all of them) share one computation per load or save."""

    blocks: torch.Tensor
    offsets: torch.Tensor
    derived: dict[object, list[Index]] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.blocks.numel())


Index = tuple[object, ...]  # an index into a strided view, or (flat element indices [heads, n, dims],)


class _StridedView:
    """K or V of every block as one `as_strided` view: [heads, blocks, token axes, dim axes]. Where the
    dims' innermost run is contiguous, its elements are read as fewer, wider integers (a bfloat16 pair
    as one int32): advanced indexing then moves 2-8 bytes per element instead of a lone bfloat16."""

    def __init__(self, cache: torch.Tensor, form: Strided, a: Addressing) -> None:
        sizes = [form.sizes[0], a.num_blocks, *form.sizes[1:]]
        strides = [form.strides[0], a.block_stride, *form.strides[1:]]
        offset = int(cache.storage_offset()) + form.base
        width = _widening(sizes[-1], strides, offset, cache.element_size()) if strides[-1] == 1 else 1
        whole = torch.empty(0, dtype=cache.dtype, device=cache.device).set_(cache.untyped_storage())
        if width > 1:
            whole = whole[: whole.numel() // width * width].view(WIDE[width * cache.element_size()])
            sizes[-1] //= width
            strides = [s if i == len(strides) - 1 else s // width for i, s in enumerate(strides)]
            offset //= width
        self.view = whole.as_strided(sizes, strides, offset)
        self.token_inner = form.token_inner
        self.width = width
        self.dtype = cache.dtype
        self.dim_axes = tuple(sizes[-2:] if form.dim_inner > 1 else sizes[-1:])

    def index(self, slots: Slots) -> Index:
        q, t = self.token_inner, slots.offsets
        return (slice(None), slots.blocks, *((t // q, t % q) if q > 1 else (t,)))

    def read(self, index: Index) -> torch.Tensor:
        got = self.view[index]  # type: ignore[index]
        if self.width > 1:
            got = got.view(self.dtype)
        return got.reshape(got.shape[0], got.shape[1], -1)

    def write(self, index: Index, x: torch.Tensor) -> None:
        if self.width > 1:
            x = _viewed(x, self.view.dtype)
        self.view[index] = x.reshape(*x.shape[:2], *self.dim_axes)  # type: ignore[index]


def _widening(run: int, strides: Sequence[int], offset: int, itemsize: int) -> int:
    """The most elements of the innermost run that one wide integer can stand for, alignment allowing."""
    for width in (8 // itemsize, 4 // itemsize, 2 // itemsize):
        ok = width > 1 and run % width == 0 and offset % width == 0
        if ok and all(s % width == 0 for s in strides[:-1]):
            return width
    return 1


def _viewed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (its last axis a run of elements) as a wider dtype, copied only if its memory does not allow it."""
    try:
        return x.view(dtype)
    except RuntimeError:
        return x.contiguous().view(dtype)


class PagedLayer:
    """One attention layer's paged cache, addressed by token slot through its page map."""

    def __init__(self, cache: torch.Tensor, page_map: PageMap, *, strided: bool = True) -> None:
        """`strided=False` takes the general path even where the map is strided (for checks and tests)."""
        self.addressing = page_map.addressing(cache)
        self.block_size = page_map.geometry.block_size
        self.device = cache.device
        self.dtype = cache.dtype
        self._flat = cache.as_strided((self.addressing.span,), (1,), cache.storage_offset())
        self._views = [
            _StridedView(cache, form, self.addressing) if strided and form is not None else None
            for form in self.addressing.strided
        ]
        self._key = (self.addressing, strided)

    @property
    def path(self) -> str:
        """How K and V move, for the start-up log: "strided" (x the elements per wide integer) or "indexed"."""
        return "/".join(
            "indexed" if v is None else "strided" + (f" x{v.width}" if v.width > 1 else "")
            for v in self._views
        )

    def slots(self, block_ids: Sequence[int], offsets: Sequence[int]) -> Slots:
        """The slots for `scatter` / `gather`, on the cache's device."""
        as_tensor = torch.as_tensor
        return Slots(
            as_tensor(block_ids, dtype=torch.long, device=self.device),
            as_tensor(offsets, dtype=torch.long, device=self.device),
        )

    def _indices(self, slots: Slots) -> list[Index]:
        if self._key not in slots.derived:
            slots.derived[self._key] = [self._index(kv, slots) for kv in range(KV)]
        return slots.derived[self._key]

    def _index(self, kv: int, slots: Slots) -> Index:
        view = self._views[kv]
        if view is not None:
            return view.index(slots)
        a = self.addressing
        return (a.offsets[kv][:, slots.offsets] + (slots.blocks * a.block_stride)[None, :, None],)

    def scatter(self, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V, each [heads, tokens, head_dim] (one token per slot), into their slots."""
        for view, index, x in zip(self._views, self._indices(slots), (k, v), strict=True):
            if view is not None:
                view.write(index, x.to(self.dtype))
            else:
                self._flat[index[0]] = x.to(self.dtype)  # type: ignore[index]

    def gather(self, slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the tokens in these slots, each a new [heads, tokens, head_dim] tensor."""
        k, v = (
            view.read(index) if view is not None else self._flat[index[0]]  # type: ignore[index]
            for view, index in zip(self._views, self._indices(slots), strict=True)
        )
        return k, v
