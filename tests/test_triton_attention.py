"""The Triton paged attention (local_runner/triton_attention.py): against a float32 reference through
page tables, and every row of a step equal to the same row computed alone (a decoding token against the
same token inside a prompt chunk, and beside other jobs). On CUDA the compiled kernels, bit for bit, in
bfloat16 too; on a CPU Triton's interpreter runs them (numpy's vectorized exp2 rounds by an element's
place in the array, so there the rows are held to a float32 rounding, not to their bits)."""

from __future__ import annotations

import functools
import os
import random

import pytest
import torch

pytest.importorskip("triton")

from local_runner import kernel_choice  # noqa: E402
from local_runner import triton_attention as ta  # noqa: E402

CUDA = torch.cuda.is_available()


def _pool(pages: int, kv_heads: int, page_tokens: int, dim: int, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    buf = torch.randn(pages, 2, kv_heads, page_tokens, dim, dtype=torch.float32).to(dtype).to(device)
    return buf[:, 0], buf[:, 1]


def _run(q, k, v, tables, jobs, lengths, heads, kv_heads, scale, config=None):
    device = q.device
    table = torch.tensor(tables, dtype=torch.int32, device=device)
    meta = ta.plan(table, jobs, lengths, heads, kv_heads, config or ta.config_for(q.dtype))
    return ta.attend(q, k, v, meta, scale)


DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 64), (8, 2, 32)])
def test_paged_attention_matches_a_reference(dtype, heads, kv_heads, dim, monkeypatch):
    monkeypatch.setattr(ta, "PARTITION", 128)  # long rows merge partitions, at a size the interpreter runs
    device = "cuda" if CUDA else "cpu"
    page_tokens = 64
    k, v = _pool(12, kv_heads, page_tokens, dim, dtype, device)
    # job 0: pages 3, 7, 1 (decoding at 150 keys); job 1: pages 0, 5, 9, 2 (a chunk at 200..211)
    tables = [[3, 7, 1, 0], [0, 5, 9, 2]]
    jobs = [0] + [1] * 12
    lengths = [150] + list(range(201, 213))
    q = torch.randn(len(jobs), heads, dim).to(dtype).to(device)
    out = _run(q, k, v, tables, jobs, lengths, heads, kv_heads, dim**-0.5)
    want = ta.reference(q.cpu(), k.cpu(), v.cpu(), tables, jobs, lengths, dim**-0.5)
    tolerance = 2e-2 if dtype != torch.float32 else 1e-4
    assert torch.allclose(out.float().cpu(), want, atol=tolerance, rtol=tolerance)


# Every config the engine may launch with (kernel_choice.py picks one per model and device).
CONFIGS = [(dtype, config) for dtype in DTYPES for config in kernel_choice.attention_candidates(dtype)]


@pytest.mark.parametrize(
    "dtype,config", CONFIGS, ids=[f"{d}-{kernel_choice.config_name(c)}" for d, c in CONFIGS]
)
def test_a_row_is_the_same_alone_and_in_any_company(dtype, config, monkeypatch):
    """A prompt chunk's tokens, each against the same token decoded alone, and beside other jobs, in
    every candidate config: whichever the device's measurement picks keeps reuse equal to recompute."""
    monkeypatch.setattr(ta, "PARTITION", 128)
    device = "cuda" if CUDA else "cpu"
    heads, kv_heads, dim, page_tokens = 6, 2, 64, 64
    k, v = _pool(10, kv_heads, page_tokens, dim, dtype, device)
    table = [2, 6, 4, 8]
    start, n = 100, 40  # a chunk at positions 100..139: rows straddle the partition boundary at 128
    q = torch.randn(n, heads, dim).to(dtype).to(device)
    run = functools.partial(_run, config=config)
    chunk = run(q, k, v, [table], [0] * n, list(range(start + 1, start + n + 1)), heads, kv_heads, 0.125)
    other = torch.randn(3, heads, dim).to(dtype).to(device)
    for i in random.Random(0).sample(range(n), 8):
        alone = run(q[i : i + 1], k, v, [table], [0], [start + i + 1], heads, kv_heads, 0.125)
        _assert_same(alone[0], chunk[i], f"token {i}")
        # beside two other jobs' tokens, at another row of the step
        mixed_q = torch.cat((other[:2], q[i : i + 1], other[2:]))
        mixed = run(
            mixed_q,
            k,
            v,
            [[1, 3, 5, 7], table],
            [0, 0, 1, 0],
            [17, 18, start + i + 1, 90],
            heads,
            kv_heads,
            0.125,
        )
        _assert_same(mixed[2], chunk[i], f"token {i} beside others")


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if CUDA:
        assert torch.equal(a, b), what
    else:
        assert torch.allclose(a.float(), b.float(), atol=1e-3, rtol=1e-3), what


def test_interpreter_is_used_on_the_cpu():
    if not CUDA:
        assert os.environ.get("TRITON_INTERPRET") == "1"


def test_more_heads_per_kv_head_than_an_item_holds_are_refused():
    """An item's BLOCK_M rows hold a token's heads of one K/V head; past BLOCK_M heads would be dropped, so
    the plan refuses them and the CUDA stack never takes such a model (the decode graphs plan directly)."""
    from types import SimpleNamespace

    from local_runner.cuda_stack import CudaStack

    table = torch.zeros(1, 1, dtype=torch.int32)
    group = ta.BLOCK_M + 1
    with pytest.raises(ValueError, match="query heads per K/V head"):
        ta.plan(table, [0], [1], heads=2 * group, kv_heads=2, config=ta.ENGINE_ATTENTION)
    assert (
        ta.plan(table, [0], [1], heads=2 * ta.BLOCK_M, kv_heads=2, config=ta.ENGINE_ATTENTION).group
        == ta.BLOCK_M
    )

    def model(heads: int, kv_heads: int) -> SimpleNamespace:
        config = SimpleNamespace(
            num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=64 * heads
        )
        return SimpleNamespace(config=config, model=SimpleNamespace(layers=[]))

    assert "at most 64 per K/V head" in CudaStack.unfit(model(2 * group, 2))
    assert CudaStack.unfit(model(32, 8)) is None


def test_float32_products_are_ieee_and_16_bit_ones_the_default():
    assert ta.dot_precision(torch.float32) == "ieee"  # Triton's default would round them to TF32
    assert ta.dot_precision(torch.bfloat16) == ta.dot_precision(torch.float16) == "tf32"


def test_the_warm_up_launches_the_merge_of_a_row_past_a_partition(monkeypatch):
    """warm_long_rows runs a row longer than a partition, so both kernels (the merge too) are compiled
    before the first job."""
    monkeypatch.setattr(ta, "PARTITION", 128)
    kernels = ta._kernels()
    launched: list[tuple[str, tuple]] = []

    class Spy:
        def __init__(self, name: str, kernel) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append((self.name, grid))
            return self.kernel[grid]

    spies = ta._Kernels(attention=Spy("attention", kernels.attention), merge=Spy("merge", kernels.merge))
    monkeypatch.setattr(ta, "_kernels", lambda: spies)
    device = "cuda" if CUDA else "cpu"
    k, v = _pool(2, 2, 64, 32, torch.float16, device)
    ta.warm_long_rows(k, v, heads=4)
    assert [name for name, _ in launched] == ["attention", "merge"]
    assert launched[0][1][2] == 2  # one item of one K/V head per program, over 2 partitions


def test_a_config_takes_only_tiles_the_kernel_can():
    """Key and query blocks are powers of two of at least 16 (tl.dot's least) that divide a partition."""
    assert ta.config_for(torch.float32).block_n == 16 and ta.config_for(torch.bfloat16) == ta.ENGINE_ATTENTION
    for bad in ({"block_n": 8}, {"block_n": 48}, {"block_m": 24}):
        with pytest.raises(ValueError, match="power of two"):
            ta.AttentionConfig(**bad)
