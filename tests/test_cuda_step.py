"""The CUDA step's forward (cuda_stack.py) and its decode graphs (cuda_graphs.py): the forward computes
what decoder.py's does; a decode step replayed from a graph's static inputs (padding rows, the padding
page) computes what the eager step computes, bit for bit. On CUDA the graphs are captured and replayed;
on a CPU Triton's kernels run under its interpreter, attention by the exact kernel through the same page
tables, and the graphs' inputs are run eagerly."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("triton")

from local_runner import exact_kernel, triton_attention  # noqa: E402
from local_runner.cuda_graphs import DecodeGraphs, buckets_up_to, partition_classes_up_to  # noqa: E402
from local_runner.cuda_stack import CudaStack  # noqa: E402
from local_runner.decoder import DecoderStack, fuse_projections  # noqa: E402
from local_runner.job_kv import JobKV  # noqa: E402
from local_runner.kv_pages import PagePool  # noqa: E402
from local_runner.packed_attention import use_packed_attention  # noqa: E402
from local_runner.step import Work, run_packed  # noqa: E402
from tests.model_fixture import REPO  # noqa: E402
from tests.tiny_model import tiny_llama, tiny_loaded  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def tiny():
    if not CUDA:
        if shutil.which("c++") is None and shutil.which("g++") is None:
            pytest.skip("no C++ compiler: the CPU attention kernel is not built")
        assert exact_kernel.build(REPO / "var" / "models") is None
    model = tiny_llama(seed=7)
    fuse_projections(model)
    lm = tiny_loaded(model=model, device=DEVICE)
    use_packed_attention(lm.model)
    return lm


def _jobs(lm, histories, page_tokens=16):
    pool = PagePool(lm.layout, lm.device, 40, page_tokens)
    kvs = [JobKV(pool) for _ in histories]
    return pool, kvs


def _prefill(lm, stack, histories, *groups) -> None:
    """Each group of jobs fed its history (job i: histories[i]) in one packed step."""
    for group in groups:
        run_packed(
            lm,
            [Work(kv, h, want_logits=False) for kv, h in zip(group, histories, strict=True)],
            stack=stack,
        )


def test_the_cuda_forward_computes_what_the_decoder_does(tiny):
    stack = CudaStack(tiny.model, invariant=True, max_positions=256)
    reference = DecoderStack(tiny.model)
    histories = [list(range(2, 40)), [5, 6, 7], list(range(10, 31))]
    _, mine = _jobs(tiny, histories)
    _, theirs = _jobs(tiny, histories)
    for kvs, forward in ((mine, stack), (theirs, reference)):
        run_packed(
            tiny,
            [Work(kv, h, want_logits=False) for kv, h in zip(kvs, histories, strict=True)],
            stack=forward,
        )
    new = [[9], [3], [4, 5, 6]]
    got = run_packed(
        tiny, [Work(kv, t, want_logits=True) for kv, t in zip(mine, new, strict=True)], stack=stack
    )
    want = run_packed(
        tiny, [Work(kv, t, want_logits=True) for kv, t in zip(theirs, new, strict=True)], stack=reference
    )
    tolerance = 1e-2 if CUDA else 1e-4  # on CUDA torch's own kernels (the reference) may use TF32
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.tensor, b.tensor, atol=tolerance, rtol=tolerance)
    for kv_a, kv_b in zip(mine, theirs, strict=True):
        for (ka, va), (kb, vb) in zip(kv_a.layers(), kv_b.layers(), strict=True):
            torch.testing.assert_close(ka, kb, atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(va, vb, atol=tolerance, rtol=tolerance)


def test_a_decode_step_as_graph_inputs_equals_the_eager_step(tiny):
    """Three decoding jobs in the bucket of four (one padding row), the same jobs stepped eagerly: the
    same logits and KV, and the padding row wrote only into the padding page."""
    stack = CudaStack(tiny.model, invariant=True, max_positions=256)
    histories = [list(range(2, 40)), [5, 6, 7], list(range(10, 45))]
    pool, kvs = _jobs(tiny, histories)
    graphs = DecodeGraphs(stack, pool, most_jobs=6, most_keys=128)
    assert graphs.buckets == [1, 2, 4, 6]
    if CUDA:
        graphs.capture()
    _, eager = _jobs(tiny, histories)
    _prefill(tiny, stack, histories, kvs, eager)
    for token in (11, 12, 13):  # three decode steps; the second crosses a page boundary for job 0 (40 -> 48)
        got = graphs.run([Work(kv, [token], want_logits=True) for kv in kvs])
        want = run_packed(tiny, [Work(kv, [token], want_logits=True) for kv in eager], stack=stack)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.tensor, b.tensor)
            assert a.step.greedy(a.index) == b.step.greedy(b.index)
    for kv_g, kv_e in zip(kvs, eager, strict=True):
        assert kv_g.length == kv_e.length
        for (ka, va), (kb, vb) in zip(kv_g.layers(), kv_e.layers(), strict=True):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
    held = {p for kv in kvs for p in kv.pages}
    assert graphs.pad_page not in held


@pytest.mark.skipif(not CUDA, reason="a CPU runs the graphs' inputs eagerly, with fresh logits each step")
def test_a_replays_rows_outlive_the_next_replay(tiny):
    """A step that runs its jobs one by one (the fallback of a failed batched step) replays the same
    graph once per job before any token is chosen: each job's rows stay its own."""
    stack = CudaStack(tiny.model, invariant=True, max_positions=256)
    histories = [list(range(2, 30)), list(range(40, 50))]
    pool, kvs = _jobs(tiny, histories)
    graphs = DecodeGraphs(stack, pool, most_jobs=2, most_keys=128)
    if CUDA:
        graphs.capture()
    _, eager = _jobs(tiny, histories)
    _prefill(tiny, stack, histories, kvs, eager)
    first = graphs.run([Work(kvs[0], [11], want_logits=True)])[0]
    second = graphs.run([Work(kvs[1], [12], want_logits=True)])[0]
    want = run_packed(
        tiny, [Work(kv, [t], want_logits=True) for kv, t in zip(eager, (11, 12), strict=True)], stack=stack
    )
    assert torch.equal(first.tensor, want[0].tensor) and torch.equal(second.tensor, want[1].tensor)


def test_a_decode_graph_takes_the_fewest_partitions_its_rows_need_and_computes_the_same(tiny, monkeypatch):
    """Partitions of 16 keys (so that short rows span several): each step replays the graph of the
    smallest partition class holding its longest row, and computes what the eager step does, bit for
    bit, whichever class that is (a row's partitions and their merge depend on its length only)."""
    monkeypatch.setattr(triton_attention, "PARTITION", 16)
    stack = CudaStack(tiny.model, invariant=True, max_positions=256)
    histories = [[5, 6, 7], list(range(2, 40)), list(range(10, 60))]
    pool, kvs = _jobs(tiny, histories)
    graphs = DecodeGraphs(stack, pool, most_jobs=4, most_keys=128)
    assert graphs.partition_classes == [1, 4, 8]
    if CUDA:
        graphs.capture()
        assert len(graphs._graphs) == len(graphs.buckets) * 3
    _, eager = _jobs(tiny, histories)
    _prefill(tiny, stack, histories, kvs, eager)
    replayed: list[int] = []
    chosen = graphs.partitions_for
    monkeypatch.setattr(graphs, "partitions_for", lambda work: replayed.append(chosen(work)) or replayed[-1])
    # job 0 alone (4 keys: 1 partition), jobs 0-1 (39 keys: 3 -> 4), all three (51 keys: 4 -> 4), then
    # job 2 past 64 keys (5 partitions -> 8)
    steps = [[0], [0, 1], [0, 1, 2]] + [[2]] * 14
    for step, jobs in enumerate(steps):
        token = 11 + step
        got = graphs.run([Work(kvs[j], [token], want_logits=True) for j in jobs])
        want = run_packed(tiny, [Work(eager[j], [token], want_logits=True) for j in jobs], stack=stack)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.tensor, b.tensor)
    assert replayed[:3] == [1, 4, 4] and replayed[-1] == 8 and 4 in replayed[3:]
    for kv_g, kv_e in zip(kvs, eager, strict=True):
        for (ka, va), (kb, vb) in zip(kv_g.layers(), kv_e.layers(), strict=True):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_partition_classes():
    assert partition_classes_up_to(1) == [1]
    assert partition_classes_up_to(4) == [1, 4]
    assert partition_classes_up_to(8) == [1, 4, 8]
    assert partition_classes_up_to(32) == [1, 4, 16, 32]  # 128k keys in partitions of 4,096
    assert partition_classes_up_to(64) == [1, 4, 16, 64]


def test_buckets():
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(16) == [1, 2, 4, 8, 16]
    assert buckets_up_to(32) == [1, 2, 4, 8, 16, 24, 32]
    assert buckets_up_to(20) == [1, 2, 4, 8, 16, 20]
