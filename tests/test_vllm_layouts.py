"""Paged KV layouts, found through the kernel that writes them (vllm_engine/link/discover.py, pages.py).

Each layout the connector supports is built as a synthetic kernel writing plain tensors (tests/support/
paged_kernels.py; no vLLM, no GPU): vLLM's described page in three stride orders (what FLASH_ATTN,
FLASHINFER and TRITON_ATTN write on CUDA), CPU_ATTN's key and value areas with keys by token or by
dimension (AVX-512, AVX2), AMX's 16-token tiles of bfloat16 pairs, the older split [2, blocks, tokens,
heads, dim] cache, and an arbitrary permutation of a block. Each must be discovered, and tokens must
round-trip through the map into other blocks leaving exactly the bytes the kernel itself leaves, in
float32, bfloat16 and float16. Kernels that scale, drop or scramble what they are given, or fail, must
be refused by name. With a vLLM CPU Python at hand, the real CPU_ATTN kernels of every ISA (vec, vec16,
amx) are mapped too, as vLLM runs them on this CPU and on one without AVX-512 (where its AVX2 build has
no AMX kernel: refused, in the kernel's words).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support.paged_kernels import (
    blocks_differ,
    cpu_amx,
    cpu_keys_by_dim,
    cpu_keys_by_token,
    dropping,
    failing,
    garbage,
    permuted,
    scaling,
    split_kv,
    vllm_page,
)
from vllm_engine.link.discover import LayoutError, WriteKV, check_round_trip, find_page_map, tagged_map
from vllm_engine.link.pages import PagedLayer, PageGeometry
from vllm_engine.link.plan import block_slots
from vllm_engine.link.setup import kernel_name, kernel_writer, paged_layers

REPO = Path(__file__).resolve().parent.parent
HEADS, DIM, BLOCK, BLOCKS = 2, 16, 32, 9
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def page_cache(order: tuple[int, ...]) -> Callable[[int, torch.dtype], torch.Tensor]:
    """vLLM's logical [blocks, heads, tokens, 2 * dim] with the axes in memory in `order` (a KVCacheLayout
    without L: (0, 1, 2, 3) blocks-heads-tokens, (0, 2, 1, 3) tokens before heads, (1, 0, 2, 3) heads first)."""
    logical = (None, HEADS, BLOCK, 2 * DIM)

    def make(blocks: int, dtype: torch.dtype) -> torch.Tensor:
        sizes = [blocks if i == 0 else logical[i] for i in order]
        return torch.zeros([int(s) for s in sizes], dtype=dtype).permute([order.index(i) for i in range(4)])

    return make


def split_cache(blocks: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(2, blocks, BLOCK, HEADS, DIM, dtype=dtype)


def _geometry_of(layout: str) -> PageGeometry:
    return PageGeometry(HEADS, DIM, BLOCK, block_dim=1 if layout == "split K/V" else 0)


LAYOUTS: dict[str, tuple[WriteKV, Callable[[int, torch.dtype], torch.Tensor]]] = {
    "vLLM page, blocks-heads-tokens": (vllm_page, page_cache((0, 1, 2, 3))),
    "vLLM page, blocks-tokens-heads": (vllm_page, page_cache((0, 2, 1, 3))),
    "vLLM page, heads outermost": (vllm_page, page_cache((1, 0, 2, 3))),
    "CPU_ATTN keys by token": (cpu_keys_by_token, page_cache((0, 1, 2, 3))),
    "CPU_ATTN keys by dim (AVX-512, AVX2)": (cpu_keys_by_dim, page_cache((0, 1, 2, 3))),
    "CPU_ATTN AMX tiles and pairs": (cpu_amx, page_cache((0, 1, 2, 3))),
    "split K/V": (split_kv, split_cache),
    "a permuted block": (permuted(7), page_cache((0, 1, 2, 3))),
}


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(HEADS, n, DIM, generator=gen), torch.randn(HEADS, n, DIM, generator=gen)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_is_found_and_round_trips_through_other_blocks(layout: str, dtype: torch.dtype):
    write, make = LAYOUTS[layout]
    page_map = find_page_map(write, make(BLOCKS, dtype), _geometry_of(layout), f"{layout} ({dtype})")
    k, v = (x.to(dtype) for x in _tokens(80, seed=1))
    block_ids, offsets = block_slots(3, 83, [5, 2, 7], BLOCK)  # the end of one block, one whole, a start
    by_kernel = make(BLOCKS, dtype)
    write(
        k.transpose(0, 1),
        v.transpose(0, 1),
        by_kernel,
        torch.tensor(block_ids) * BLOCK + torch.tensor(offsets),
    )
    for strided in (True, False):
        cache = make(BLOCKS, dtype)
        layer = PagedLayer(cache, page_map, strided=strided)
        slots = layer.slots(block_ids, offsets)
        layer.scatter(slots, k, v)
        assert torch.equal(cache, by_kernel)  # the kernel's bytes in the kernel's places, nothing elsewhere
        got_k, got_v = PagedLayer(by_kernel, page_map, strided=strided).gather(slots)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_the_fast_path_covers_every_strided_layout_and_amx_pairs_move_as_wide_integers():
    paths = {}
    for layout, (write, make) in LAYOUTS.items():
        cache = make(BLOCKS, torch.bfloat16)
        paths[layout] = PagedLayer(cache, find_page_map(write, cache, _geometry_of(layout), layout)).path
    assert paths["a permuted block"] == "indexed/indexed"
    assert all("indexed" not in p for name, p in paths.items() if name != "a permuted block"), paths
    assert paths["CPU_ATTN AMX tiles and pairs"].startswith("strided x2/")  # a bfloat16 pair as one int32
    assert paths["vLLM page, blocks-heads-tokens"] == "strided x4/strided x4"  # 4 bfloat16 as one int64


def test_a_map_from_a_small_scratch_cache_serves_a_big_cache_with_other_strides():
    """The map is logical: found on 2-3 blocks, it must address a cache of many, whatever its strides."""
    make = page_cache((1, 0, 2, 3))  # heads outermost: the head stride grows with the number of blocks
    small, big = make(2, torch.float32), make(50, torch.float32)
    page_map = find_page_map(vllm_page, small, _geometry_of("vLLM page"), "vLLM page")
    layer = PagedLayer(big, page_map)
    k, v = _tokens(70, seed=2)
    slots = layer.slots(*block_slots(0, 70, [49, 3, 20], BLOCK))
    layer.scatter(slots, k, v)
    by_kernel = make(50, torch.float32)
    vllm_page(k.transpose(0, 1), v.transpose(0, 1), by_kernel, slots.blocks * BLOCK + slots.offsets)
    assert torch.equal(big, by_kernel)


def test_the_described_page_is_taken_where_the_kernel_writes_it_and_the_tags_elsewhere():
    cache = page_cache((0, 1, 2, 3))(BLOCKS, torch.bfloat16)
    assert find_page_map(vllm_page, cache, _geometry_of("vLLM page"), "x").source == "vLLM's page"
    assert find_page_map(cpu_amx, cache, _geometry_of("amx"), "x").source == "found through the kernel"


def test_tags_are_exact_in_bfloat16_for_blocks_of_many_thousand_elements():
    """2 x 2 blocks x 128 tokens x 4 heads x 64 = 131,072 elements: three bfloat16 digits each."""
    geometry = PageGeometry(4, 64, 128)
    cache = torch.zeros(3, 4, 128, 128, dtype=torch.bfloat16)
    page_map = tagged_map(cpu_keys_by_dim, cache, geometry)
    check_round_trip(cpu_keys_by_dim, cache, page_map)
    key_at, value_at = 3 * 128 + 5, 128 * 64 + 5 * 64 + 3  # (head 1, token 5, dim 3) in its head's areas
    assert page_map.coords[0, 1, 5, 3].tolist() == [0, 1, key_at // 128, key_at % 128]
    assert page_map.coords[1, 1, 5, 3].tolist() == [0, 1, value_at // 128, value_at % 128]


# ---- kernels no map explains: refused at start, by name ---------------------------------------------------


@pytest.mark.parametrize(
    ("kernel", "reason"),
    [
        (scaling, "not store values as given"),
        (dropping, "not stored once each"),
        (garbage, "not store values as given|not stored once each"),
        (blocks_differ, "lays blocks out differently"),
        (failing, "unsupported ISA"),
    ],
)
def test_a_kernel_no_map_explains_is_refused_naming_backend_dtype_and_isa(kernel, reason):
    cache = page_cache((0, 1, 2, 3))(BLOCKS, torch.bfloat16)
    what = "CPU_ATTN (bfloat16, ISA test-isa)"
    with pytest.raises(LayoutError, match=reason) as refused:
        find_page_map(kernel, cache, _geometry_of("cpu"), what)
    assert what in str(refused.value) and "cannot map" in str(refused.value)


def test_a_map_the_kernel_disagrees_with_fails_the_round_trip():
    cache = page_cache((0, 1, 2, 3))(BLOCKS, torch.float32)
    by_token = tagged_map(cpu_keys_by_token, cache, _geometry_of("cpu"))
    with pytest.raises(LayoutError, match="differ from the kernel"):
        check_round_trip(cpu_keys_by_dim, cache, by_token)


# ---- the start: one map per kind of layer, named in the log and in refusals -------------------------------


def _attention_layer(write: WriteKV, backend: str = "CPU_ATTN", isa: str = "amx") -> SimpleNamespace:
    impl = SimpleNamespace(do_kv_cache_update=lambda layer, k, v, cache, slots: write(k, v, cache, slots))
    return SimpleNamespace(impl=impl, isa=isa, attn_backend=SimpleNamespace(get_name=lambda: backend))


def test_the_start_finds_one_map_for_all_layers_through_each_layers_own_kernel():
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    calls = []

    def counted(key, value, cache, slots):
        calls.append(cache.shape[0])
        cpu_amx(key, value, cache, slots)

    caches = {n: page_cache((0, 1, 2, 3))(BLOCKS, torch.bfloat16) for n in names}
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(
            static_forward_context={n: _attention_layer(counted) for n in names}
        )
    )
    layers, notes = paged_layers(config, caches, names, PageGeometry(HEADS, DIM, BLOCK))
    assert len(layers) == 3 and len({id(layer.addressing) for layer in layers}) == 1
    assert all(blocks < BLOCKS for blocks in calls)  # only scratch caches were written, never vLLM's
    assert all(float(c.abs().sum()) == 0 for c in caches.values())
    assert (
        len(notes) == 1
        and "CPU_ATTN (bfloat16, ISA amx" in notes[0]
        and "found through the kernel" in notes[0]
    )
    k, v = _tokens(20, seed=3)
    slots = layers[0].slots(*block_slots(0, 20, [4], BLOCK))
    layers[2].scatter(slots, k, v)
    by_kernel = page_cache((0, 1, 2, 3))(BLOCKS, torch.bfloat16)
    cpu_amx(
        k.transpose(0, 1).bfloat16(), v.transpose(0, 1).bfloat16(), by_kernel, torch.arange(20) + 4 * BLOCK
    )
    assert torch.equal(caches[names[2]], by_kernel)


def test_layers_of_two_kinds_get_a_map_each_and_share_one_set_of_slots():
    """Slots made by the first layer serve a layer of another kind (its own indices, derived once)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    caches = {names[0]: page_cache((0, 1, 2, 3))(BLOCKS, torch.float32)}
    caches[names[1]] = page_cache((1, 0, 2, 3))(BLOCKS, torch.float32)
    context = {n: _attention_layer(vllm_page, backend="FLASH_ATTN") for n in names}
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=context))
    layers, notes = paged_layers(config, caches, names, PageGeometry(HEADS, DIM, BLOCK))
    assert len(notes) == 2 and layers[0].addressing is not layers[1].addressing
    k, v = _tokens(50, seed=4)
    slots = layers[0].slots(*block_slots(0, 50, [6, 1], BLOCK))
    for layer in layers:
        layer.scatter(slots, k, v)
        got_k, got_v = layer.gather(slots)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert torch.equal(caches[names[0]], caches[names[1]])  # the same tokens in the same logical places


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["vLLM page, blocks-tokens-heads", "CPU_ATTN AMX tiles and pairs"])
def test_the_discovery_runs_on_the_cuda_device_where_the_cache_is(layout: str):
    write, make = LAYOUTS[layout]
    cache = make(BLOCKS, torch.bfloat16).cuda()
    page_map = find_page_map(write, cache, _geometry_of(layout), layout)
    layer = PagedLayer(cache, page_map)
    k, v = (x.cuda().bfloat16() for x in _tokens(40, seed=5))
    slots = layer.slots(*block_slots(5, 45, [3, 8], BLOCK))
    layer.scatter(slots, k, v)
    got_k, got_v = layer.gather(slots)
    assert got_k.is_cuda and torch.equal(got_k, k) and torch.equal(got_v, v)


def test_the_kernel_and_its_name_come_from_vllms_layer():
    cache = torch.zeros(2, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
    name = kernel_name(SimpleNamespace(isa="vec16"), "CPU_ATTN", cache)
    assert name.startswith("CPU_ATTN (bfloat16, ISA vec16")
    with pytest.raises(LayoutError, match="no do_kv_cache_update"):
        kernel_writer(SimpleNamespace(impl=object()))


def test_a_page_map_refuses_a_cache_it_does_not_fit():
    cache = page_cache((0, 1, 2, 3))(BLOCKS, torch.float32)
    page_map = find_page_map(vllm_page, cache, _geometry_of("vLLM page"), "x")
    with pytest.raises(ValueError, match="beyond the cache's shape"):
        PagedLayer(torch.zeros(BLOCKS, HEADS, BLOCK, DIM), page_map)


# ---- the real CPU_ATTN kernels (a vLLM CPU Python: make vllm) ----------------------------------------------

VLLM_PYTHON = os.path.abspath(
    os.environ.get("ATTNSTORE_TEST_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
)
REAL_KERNELS = textwrap.dedent(
    """
    import json, sys, torch
    if sys.argv[1:] == ["avx2"]:  # vLLM as it picks its kernels on a CPU without AVX-512 or AMX
        torch.cpu._is_avx512_supported = lambda: False
        torch.cpu._is_amx_tile_supported = lambda: False
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from vllm_engine.link.discover import find_page_map, LayoutError
    from vllm_engine.link.pages import PagedLayer, PageGeometry

    def writer(isa):
        def write(key, value, cache, slots):  # CPU_ATTN's do_kv_cache_update, with the ISA given
            b, h, n, _ = cache.shape
            key_cache, value_cache = cache.view(b, h, 2 * n, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
        return write

    out, picked = {}, {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for heads, block, dim in ((3, 128, 64), (2, 32, 128)):
            shape = f"{dtype} {heads}x{block}x{dim}"
            picked[shape] = _get_attn_isa(dtype, block, dim)
            for isa in ("vec", "vec16", "amx"):
                cache = torch.zeros(20, heads, block, 2 * dim, dtype=dtype)
                what = f"{isa} {shape}"
                try:
                    m = find_page_map(writer(isa), cache, PageGeometry(heads, dim, block), what)
                    out[what] = PagedLayer(cache, m).path + " " + m.source
                except LayoutError as exc:
                    out[what] = "refused: " + str(exc)
    print(json.dumps({"found": out, "picked": picked}))
    """
)


@pytest.mark.parametrize("cpu", ["this CPU", "avx2"])
def test_the_real_cpu_kernels_of_every_isa_are_mapped_or_refused_by_name_in_every_dtype(cpu: str):
    """Every ISA's kernel in every dtype: mapped onto the fast path, or (an ISA this CPU or this vLLM build
    cannot run: AMX under vLLM's AVX2 build) refused with the kernel's own words, never mapped wrong. The
    ISA vLLM itself picks for each dtype and shape is always mapped. `avx2`: vLLM as it runs on a CPU
    without AVX-512 or AMX (its kernel choice simulated), so both kinds of CPU are covered on either."""
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.skip(f"no vLLM Python at {VLLM_PYTHON} (make vllm, or set ATTNSTORE_TEST_VLLM_PYTHON)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [VLLM_PYTHON, "-c", REAL_KERNELS, *(["avx2"] if cpu == "avx2" else [])]
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    found, picked = result["found"], result["picked"]
    assert len(found) == 18 and len(picked) == 6, result
    refused = {w: p for w, p in found.items() if p.startswith("refused")}
    # A refusal is the kernel failing on the scratch cache (and saying why), never a layout mapped wrong.
    assert all("the kernel failed on a scratch cache" in p for p in refused.values()), refused
    assert not [w for w in refused if not w.startswith("amx ")], refused  # the vector ISAs run anywhere
    for shape, isa in picked.items():  # what vLLM would run here is mapped
        assert not found[f"{isa} {shape}"].startswith("refused"), (shape, isa, found)
    mapped = {w: p for w, p in found.items() if w not in refused}
    assert all("indexed" not in p for p in mapped.values()), found  # every real layout takes the fast path
    amx16 = found["amx torch.bfloat16 3x128x64"]
    if (
        "amx torch.bfloat16 3x128x64" not in refused
    ):  # AMX packs bfloat16 pairs, unlike float32 and the vector ISAs
        assert amx16 != found["vec torch.bfloat16 3x128x64"] and amx16.startswith("strided x2/"), found
    if cpu == "avx2":
        assert "amx" not in picked.values(), picked
    print(sys.version, result)
