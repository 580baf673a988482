"""Exact attention (issue 29), the kernel and the padded calls: a row's attention output is bit for bit
the one it gets alone, whether it is decoded beside other jobs of any length or computed inside a prompt
chunk of any size and offset, in float32 and bfloat16. No model: random queries against a random KV pool, shaped as SmolLM2's (9 query
heads sharing 3 K/V heads, head_dim 64)."""

from __future__ import annotations

import shutil

import pytest
import torch

from local_runner import exact_kernel
from local_runner.exact_attention import decode_bias, decode_rows, padded_keys, prefill_rows
from tests.model_fixture import REPO

HEADS, KV_HEADS, DIM, CAPACITY = 9, 3, 64, 1024
SCALE = DIM**-0.5


def pool(dtype: torch.dtype, slots: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(slots, KV_HEADS, CAPACITY, DIM, generator=g).to(dtype)
    v = torch.randn(slots, KV_HEADS, CAPACITY, DIM, generator=g).to(dtype)
    return k, v


def queries(n: int, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    return torch.randn(n, HEADS, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int, length: int) -> torch.Tensor:
    """One token decoded alone: its query against its slot's first `length` keys."""
    bias = decode_bias([length], CAPACITY, q.device)
    return decode_rows(q[None], k[slot : slot + 1], v[slot : slot + 1], bias, SCALE)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_chunk_row_equals_the_token_decoded_alone(dtype):
    k, v = pool(dtype)
    q = queries(300, dtype)
    for past, n in [(0, 1), (0, 2), (0, 7), (0, 64), (0, 300), (5, 3), (37, 130), (200, 100), (600, 257)]:
        chunk = prefill_rows(q[:n], k[0], v[0], past, SCALE)
        for j in sorted({0, min(1, n - 1), n // 2, n - 1}):
            assert torch.equal(chunk[j], alone(q[j], k, v, 0, past + j + 1)), (past, n, j)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_of_any_size_give_the_same_rows(dtype):
    k, v = pool(dtype)
    q = queries(512, dtype)
    whole = prefill_rows(q, k[1], v[1], 0, SCALE)
    for size in (64, 100, 256):
        parts = [prefill_rows(q[a : a + size], k[1], v[1], a, SCALE) for a in range(0, 512, size)]
        assert torch.equal(torch.cat(parts), whole), size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_beside_jobs_of_other_lengths_equals_alone(dtype):
    k, v = pool(dtype)
    q = queries(6, dtype)
    for lengths in ([1, 2, 3, 4, 5, 6], [17, 900, 64, 65, 1, 300], [1000, 1024, 5, 513, 129, 8]):
        batched = decode_rows(q, k, v, decode_bias(lengths, CAPACITY, q.device), SCALE)
        for r, length in enumerate(lengths):
            assert torch.equal(batched[r], alone(q[r], k, v, r, length)), (lengths, r)


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int, past: int) -> torch.Tensor:
    """torch's own attention of a prompt chunk q after `past` stored tokens of `slot` (the reference)."""
    n = q.shape[0]
    mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[slot : slot + 1, :, : past + n],
        v[slot : slot + 1, :, : past + n],
        attn_mask=mask,
        scale=SCALE,
        enable_gqa=True,
    )[0].transpose(0, 1)


def test_exact_attention_is_attention():
    """The exact calls compute what torch's attention computes (to float32 rounding)."""
    k, v = pool(torch.float32)
    q = queries(40, torch.float32)
    past = 90
    got = prefill_rows(q, k[2], v[2], past, SCALE)
    torch.testing.assert_close(got, torch_attention(q, k, v, 2, past), rtol=1e-5, atol=1e-5)
    assert padded_keys(1) == 64 and padded_keys(64) == 64 and padded_keys(65) == 128


PAGE = 256


def paged(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slot pools as the engine's pages: each slot's keys cut into pages of PAGE tokens, the pages
    shuffled and laid out as one pool's layer ([pages, kv_heads, PAGE, dim] views of K and V, K and V of
    a page side by side, as kv_pages.py lays them out); the page table of each slot."""
    slots, per = k.shape[0], CAPACITY // PAGE
    order = torch.randperm(slots * per, generator=torch.Generator().manual_seed(3))
    both = torch.stack((k, v), dim=1)  # [slots, 2, kv_heads, CAPACITY, dim]
    pages = (
        both.view(slots, 2, KV_HEADS, per, PAGE, DIM)
        .permute(0, 3, 1, 2, 4, 5)
        .reshape(-1, 2, KV_HEADS, PAGE, DIM)
    )
    pool = torch.empty_like(pages)
    pool[order] = pages  # page i of the slots' run lands at pool[order[i]]
    tables = order.view(slots, per)
    return pool[:, 0], pool[:, 1], tables


@pytest.fixture(scope="module")
def kernel():
    """The C++ kernel, built as the runner builds it (under var/models: once per machine)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the runner uses the padded calls")
    assert exact_kernel.build(REPO / "var" / "models") is None  # a compiler is here: it must build
    return exact_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_every_row_as_alone(kernel, dtype):
    """One call for a whole step: a prompt chunk of slot 0 and decoding rows of other slots; each row
    equals the row computed alone, and a chunk split differently gives the same rows."""
    k, v, tables = paged(*pool(dtype))
    q = queries(300, dtype)
    slots = torch.tensor([0] * 290 + [1, 2, 3, 4, 5, 1, 2, 3, 4, 5])
    lengths = torch.tensor([600 + i + 1 for i in range(290)] + [1, 17, 64, 65, 900, 2, 3, 1000, 129, 8])
    step = kernel.attend(q, k, v, tables, slots, lengths, SCALE)
    for r in (0, 1, 100, 289, 290, 293, 294, 297, 299):
        alone = kernel.attend(q[r : r + 1], k, v, tables, slots[r : r + 1], lengths[r : r + 1], SCALE)
        assert torch.equal(step[r : r + 1], alone), r
    halves = torch.cat(
        [kernel.attend(q[a:b], k, v, tables, slots[a:b], lengths[a:b], SCALE) for a, b in ((0, 7), (7, 300))]
    )
    assert torch.equal(halves, step)


@pytest.mark.parametrize("past", [90, 300, 700])  # within the first page, and across pages
def test_the_kernel_is_attention_through_the_page_tables(kernel, past):
    k, v = pool(torch.float32)
    k_pages, v_pages, tables = paged(k, v)
    q = queries(40, torch.float32)
    got = kernel.attend(
        q, k_pages, v_pages, tables, torch.full((40,), 2), torch.arange(past + 1, past + 41), SCALE
    )
    torch.testing.assert_close(got, torch_attention(q, k, v, 2, past), rtol=1e-5, atol=1e-5)


class RowCountDependent(torch.nn.Linear):
    """A linear layer whose kernel rounds by the row count (as MKL's float32 products do from 2 rows on):
    each row's result carries a trace of how many rows shared its call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1 + 1e-6 * (x.reshape(-1, 16).shape[0] % 16))


def test_a_linear_layer_that_rounds_by_the_row_count_is_measured_and_tiled():
    from local_runner.dense import FixedRowsLinear, make_rows_invariant, rows_are_independent

    model = torch.nn.Sequential(RowCountDependent(16, 8, bias=False))
    assert not rows_are_independent(model[0], 16, torch.float32, 40, torch.device("cpu"))
    assert make_rows_invariant(model, torch.float32, torch.device("cpu"), max_rows=40)
    assert isinstance(model[0], FixedRowsLinear)  # padded tiles: each call has 16 rows
    x = torch.randn(37, 16)
    with torch.inference_mode():
        assert torch.equal(model(x)[5:6], model(x[5:6]))


class OneRowKernel(torch.nn.Linear):
    """A linear layer with a kernel of its own for one row (as oneDNN's bfloat16 1536 -> 576 product on
    AVX-512 BF16): a row alone rounds differently from the same row among any number of others."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1 + 1e-6 * (x.reshape(-1, 16).shape[0] == 1))


def test_a_linear_layer_whose_one_row_kernel_differs_gets_two_rows_per_call_not_tiles():
    from local_runner.dense import MinRowsLinear, make_rows_invariant, rows_are_independent

    model = torch.nn.Sequential(OneRowKernel(16, 8, bias=False))
    assert not rows_are_independent(model[0], 16, torch.float32, 40, torch.device("cpu"))
    assert rows_are_independent(model[0], 16, torch.float32, 40, torch.device("cpu"), min_rows=2)
    assert make_rows_invariant(model, torch.float32, torch.device("cpu"), max_rows=40)
    assert isinstance(model[0], MinRowsLinear) and model[0].rows == 2
    x = torch.randn(37, 16)
    with torch.inference_mode():
        whole = model(x)
        assert all(torch.equal(whole[r : r + 1], model(x[r : r + 1])) for r in (0, 5, 36))
        assert torch.equal(whole[:3], model(x[:3]))


class KernelPast32Rows(torch.nn.Linear):
    """A linear layer that computes a call of up to 32 rows as each row alone and takes another kernel
    past that (as oneDNN's bfloat16 products on AMX do: docs/engine.md, "Batch invariance"): some rows
    of a longer call round differently."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, 16)  # each row's products summed on its own (MKL's float32 gemm is not)
        y = (rows[:, None, :] * self.weight).sum(-1) * (1 + 1e-6 * (rows.shape[0] > 32))
        return y.reshape(*x.shape[:-1], -1)


def test_a_linear_layer_that_changes_kernel_past_32_rows_gets_at_most_32_rows_per_call_unpadded():
    from local_runner.dense import MaxRowsLinear, make_rows_invariant, measure_rule

    cpu = torch.device("cpu")
    assert measure_rule(KernelPast32Rows(16, 8, bias=False), 16, torch.float32, 100, cpu) == "at-most-32"
    model = torch.nn.Sequential(KernelPast32Rows(16, 8, bias=False))
    assert make_rows_invariant(model, torch.float32, cpu, max_rows=100)
    assert isinstance(model[0], MaxRowsLinear) and model[0].rows == 32
    calls = []
    model[0].inner.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    x = torch.randn(70, 16)
    with torch.inference_mode():
        whole = model(x)
        assert calls == [32, 32, 6]  # nothing padded
        assert all(torch.equal(whole[r : r + 1], model(x[r : r + 1])) for r in (0, 31, 32, 69))
        assert calls[3:] == [1, 1, 1, 1]


def test_the_amx_linear_kernel_computes_every_row_as_alone_with_a_weight_read_once_per_call(kernel):
    """exact_linear.cpp (bfloat16 on a CPU with AMX): each row of a call of any size equals the row
    alone, bit for bit, bias included; the result is the product to bfloat16 rounding."""
    if not kernel.amx_linear_ready():
        pytest.skip("this CPU has no AMX with bfloat16 (or the kernel is not built): oneDNN's products serve")
    from local_runner.dense import ExactLinear

    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(96, 64).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 96, generator=g) * 0.1)
        linear.bias.copy_(torch.randn(64, generator=g))
    exact = ExactLinear(linear)
    x = torch.randn(300, 96, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([exact(x[r : r + 1]) for r in range(300)])
        for rows in (2, 15, 16, 17, 31, 32, 33, 100, 300):
            assert torch.equal(exact(x[:rows]), alone[:rows]), rows
        assert torch.equal(exact(x[:40].view(4, 10, 96)), alone[:40].view(4, 10, 64))
        reference = x.double() @ linear.weight.double().t() + linear.bias.double()
        torch.testing.assert_close(alone.double(), reference, rtol=1e-2, atol=1e-2)
        with pytest.raises(RuntimeError, match="multiples of 32"):
            torch.ops.attnstore.amx_pack(torch.zeros(40, 96, dtype=torch.bfloat16))


def torch_elementwise(x, delta, weight, qkv, cos, sin, rotated_heads, gate_up):
    """decoder.py's torch operations for the same work: (x + delta, its norm, q/k rotated, SiLU * up)."""
    import torch.nn.functional as F

    from local_runner.decoder import _rms_norm, _rotate

    added = x + delta
    gate, up = gate_up.chunk(2, dim=-1)
    rotated = _rotate(qkv[:, :rotated_heads], cos[:, None], sin[:, None])
    return added, _rms_norm(added, weight, 1e-5), rotated, F.silu(gate) * up


def elementwise_inputs(rows: int, dtype: torch.dtype, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x, delta = (torch.randn(rows, 576, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=g).to(dtype)
    qkv = torch.randn(rows, 15, 64, generator=g).to(dtype)
    half = torch.randn(rows, 32, generator=g)
    cos, sin = torch.cat([half.cos()] * 2, -1).to(dtype), torch.cat([half.sin()] * 2, -1).to(dtype)
    gate_up = (4 * torch.randn(rows, 3072, generator=g)).to(dtype)
    return x, delta, weight, qkv, cos, sin, gate_up


def fused_elementwise(x, delta, weight, qkv, cos, sin, rotated_heads, gate_up):
    """exact_elementwise.cpp's operators for torch_elementwise's work (on copies: two operate in place)."""
    ops = torch.ops.attnstore
    added, rotated = x.clone(), qkv.clone()
    normed = ops.add_rms_norm_(added, delta, weight, 1e-5)
    ops.rotary_(rotated, cos, sin, rotated_heads)
    assert torch.equal(rotated[:, rotated_heads:], qkv[:, rotated_heads:])  # v untouched
    assert torch.equal(ops.rms_norm(added, weight, 1e-5), normed)
    return added, normed, rotated[:, :rotated_heads], ops.silu_mul(gate_up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_elementwise_operators_compute_what_torch_does(kernel, dtype):
    """The residual add, RMSNorm, rotary and SiLU * up of the exact step, fused: in bfloat16 torch's
    result bit for bit (each operation rounded where torch rounds it), in float32 to a few ulps (only the
    mean's summation order and the exponential's polynomial differ)."""
    inputs = elementwise_inputs(37, dtype)
    x, delta, weight, qkv, cos, sin, gate_up = inputs
    got = fused_elementwise(x, delta, weight, qkv, cos, sin, 12, gate_up)
    want = torch_elementwise(x, delta, weight, qkv, cos, sin, 12, gate_up)
    assert torch.equal(got[0], want[0])  # one addition, one rounding: the same in any dtype
    for a, b in zip(got[1:], want[1:], strict=True):
        if dtype == torch.bfloat16:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_elementwise_operators_compute_every_row_as_alone(kernel, dtype):
    """A row's result is the same alone, among 600 rows (a prompt chunk's, split between threads) or
    at any offset: the operators never group rows."""
    inputs = elementwise_inputs(600, dtype)
    whole = fused_elementwise(*inputs[:6], 12, inputs[6])
    for first, n in ((0, 1), (299, 1), (17, 5), (512, 88)):
        rows = [t[first : first + n] for t in inputs]
        rows[2] = inputs[2]  # the weight is shared
        part = fused_elementwise(*rows[:6], 12, rows[6])
        for a, b in zip(part, whole, strict=True):
            assert torch.equal(a, b[first : first + n]), (first, n)


def test_the_decoder_stack_on_the_fused_operators_computes_what_it_does_on_torchs(kernel):
    """The eager forward with the fused operators (use_fused_elementwise, as the exact step runs it)
    against the same forward on torch's operations: logits and K/V to float32 rounding."""
    from local_runner.decoder import DecoderStack
    from local_runner.loader import fuse_llama_projections
    from local_runner.packed_attention import use_packed_attention
    from local_runner.step import Work, run_packed
    from tests.test_local_runner_units import _shared
    from tests.tiny_model import tiny_llama, tiny_loaded

    lm = tiny_loaded(model=tiny_llama(seed=6))
    fuse_llama_projections(lm.model)
    use_packed_attention(lm.model)
    fused, plain = DecoderStack(lm.model), DecoderStack(lm.model)
    assert fused.use_fused_elementwise() and not plain.fused
    results = []
    for stack in (fused, plain):
        a, b = _shared(lm, 2)
        first = run_packed(lm, [Work(a, [5, 9, 13, 2], want_logits=True)], stack=stack)
        second = run_packed(
            lm, [Work(a, [40], want_logits=True), Work(b, [7, 8, 9], want_logits=True)], stack=stack
        )
        results.append(
            ([r.tensor for r in first + second], [t for kv in (a, b) for pair in kv.layers() for t in pair])
        )
    (logits, kv), (ref_logits, ref_kv) = results
    for x, y in zip(logits + kv, ref_logits + ref_kv, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_the_rows_measured_are_kept_per_machine_and_a_corrupt_file_is_measured_again(tmp_path, monkeypatch):
    """batch_invariant's measurement of the linear layers (15 s of a start) is kept under the machine's
    folder: a second start wraps the same layers without measuring; a corrupt file is measured again
    and rewritten, never trusted."""
    import json

    from local_runner import dense, model_step
    from local_runner.dense import FixedRowsLinear
    from tests.tiny_model import tiny_llama, tiny_loaded

    monkeypatch.setattr(exact_kernel, "_cache_dir", tmp_path)
    calls = []
    measure = dense.rows_are_independent
    monkeypatch.setattr(dense, "rows_are_independent", lambda *a, **k: calls.append(1) or measure(*a, **k))

    def start():
        """A model as a runner loads it, its head a kernel that rounds by the row count."""
        lm = tiny_loaded(model=tiny_llama(seed=7))
        lm.model.lm_head = RowCountDependent(64, 80, bias=False)
        calls.clear()
        model_step._make_rows_invariant(lm, 40)
        assert lm.rows_invariant and isinstance(lm.model.lm_head, FixedRowsLinear)
        return len(calls)

    path = model_step.rows_file(torch.float32, 40)
    path.parent.mkdir(parents=True)
    stale = path.with_name(path.name.rsplit("-", 1)[0] + "-0ldd1ges.json")  # an older dense.py's
    other = path.with_name(path.name.replace("-40-", "-41-"))  # another measurement, still valid
    stale.write_text("{}")
    other.write_text("{}")
    assert start() > 0 and path.parent.parent == tmp_path / "kernels"
    assert not stale.exists() and other.exists()
    kept = json.loads(path.read_text())
    assert kept["RowCountDependent:64x80:nobias"] == "tiles"
    assert start() == 0  # nothing measured: the kept file says it all
    path.write_text('{"RowCountDependent:64x80:nobias": "one"')
    assert start() > 0 and json.loads(path.read_text()) == kept


def test_a_build_lock_left_by_a_killed_builder_does_not_stop_the_next_start(kernel):
    """A start killed while it built the kernel leaves cpp_extension's `lock` file behind; the next start
    (a process of its own: a library is loaded once per process) builds or loads anyway instead of
    waiting for it forever."""
    import subprocess
    import sys

    folder = kernel.machine_folder()
    (folder / "lock").touch()
    code = (
        "import sys; from pathlib import Path; from local_runner import exact_kernel; "
        f"sys.exit(0 if exact_kernel.build(Path({str(REPO / 'var' / 'models')!r})) is None else 1)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (folder / "lock").exists()
