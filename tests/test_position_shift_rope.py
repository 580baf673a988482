"""Moving stored keys by -T positions equals computing them at p - T, for every RoPE the runner shifts.

Each case builds a tiny random model of that family and RoPE type, computes keys through the model's own
rotary module and apply_rotary_pos_emb at positions p and p - T, and moves the first by -T with the
RopeShift read from the model (rope_config), the way the runner does.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from local_runner.rope_config import rope_shift_for
from local_runner.rope_shift import RopeShift

SMALL = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)

CASES = {
    "llama-default": ("llama", {"rope_theta": 10000.0, "rope_type": "default"}, {}),
    "llama-linear": ("llama", {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0}, {}),
    "llama-llama3": (
        "llama",
        {
            "rope_theta": 500000.0,
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        {},
    ),
    "llama-yarn": (
        "llama",
        {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        {},
    ),
    "qwen2-default": ("qwen2", {"rope_theta": 1000000.0, "rope_type": "default"}, {}),
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_theta": 1000000.0,
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 512,
        },
        {},
    ),
    "stablelm-partial": (
        "stablelm",
        {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25},
        {},
    ),
    "glm-interleaved-partial": (
        "glm",
        {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
        {"head_dim": 16, "pad_token_id": 0},
    ),
}


def tiny(model_type: str, rope: dict, extra: dict):
    config = AutoConfig.for_model(model_type, **SMALL, **extra, rope_parameters=rope)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def keys_at(model, k: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """k ([1, heads, n, head_dim]) with RoPE at `positions`, by the model's own code."""
    module = importlib.import_module(type(model).__module__)
    pos = torch.tensor([positions])
    cos, sin = model.model.rotary_emb(k, pos)
    if model.config.model_type == "stablelm":  # its attention rotates the first dims, as here
        rot = cos.shape[-1]
        _, out = module.apply_rotary_pos_emb(k[..., :rot], k[..., :rot], cos, sin)
        return torch.cat((out, k[..., rot:]), dim=-1)
    _, out = module.apply_rotary_pos_emb(k, k, cos, sin)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("case", sorted(CASES))
def test_keys_rotated_by_minus_t_equal_keys_computed_at_p_minus_t(case):
    model_type, rope, extra = CASES[case]
    model = tiny(model_type, rope, extra)
    shift = rope_shift_for(model)
    assert isinstance(shift, RopeShift), shift
    head_dim = extra.get("head_dim", SMALL["hidden_size"] // SMALL["num_attention_heads"])
    assert shift.interleaved == (model_type == "glm")
    assert shift.rotary_dim == int(head_dim * rope.get("partial_rotary_factor", 1.0))
    torch.manual_seed(1)
    k = torch.randn(1, 2, 40, head_dim) * 4
    for t in (1, 37, 300):
        old = list(range(t + 200, t + 240))  # stored at old positions, moved down by t
        new = [p - t for p in old]
        moved = shift.rotate(keys_at(model, k, old), -t)
        expected = keys_at(model, k, new)
        assert rel_err(moved, expected) <= 1e-4, (case, t)
        # The runner's way: one matrix for the turn, one product per layer.
        by_matrix = torch.empty_like(expected)
        shift.move_into(keys_at(model, k, old), by_matrix, shift.matrix(-t, head_dim))
        assert rel_err(by_matrix, expected) <= 1e-4, (case, t)
        # Without the rotation the keys are far off: the test can fail.
        assert rel_err(keys_at(model, k, old), expected) > 1e-2


def test_attention_scaling_stays_in_the_shifted_keys():
    """yarn scales cos/sin by its attention factor: the stored keys carry it once, and so must the moved."""
    model = tiny("llama", CASES["llama-yarn"][1], {})
    assert model.model.rotary_emb.attention_scaling != 1.0
    k = torch.randn(1, 2, 8, 16)
    moved = rope_shift_for(model).rotate(keys_at(model, k, list(range(100, 108))), -50)  # type: ignore[union-attr]
    assert rel_err(moved, keys_at(model, k, list(range(50, 58)))) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_move_within_one_buffer_reads_the_run_before_it_overwrites_it(dtype):
    """The kept run moves down by less than its length: source and target overlap in the slot."""
    shift = RopeShift(1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)))
    torch.manual_seed(2)
    slot = torch.randn(1, 2, 50, 16).to(dtype)
    src, keep, n = 12, 4, 30  # [12, 42) -> [4, 34)
    expected = shift.rotate(slot[:, :, src : src + n], keep - src)
    shift.move_into(slot[:, :, src : src + n], slot[:, :, keep : keep + n], shift.matrix(keep - src, 16))
    assert slot.dtype == dtype
    assert rel_err(slot[:, :, keep : keep + n].float(), expected.float()) <= (
        1e-6 if dtype == torch.float32 else 1e-2
    )


def test_bfloat16_keys_stay_bfloat16_and_close():
    shift = RopeShift(1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)))
    k = torch.randn(1, 2, 5, 16, dtype=torch.bfloat16)
    out = shift.rotate(k, -7)
    assert out.dtype == torch.bfloat16
    back = shift.rotate(out, 7)
    assert rel_err(back.float(), k.float()) < 2e-2


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0},
        {
            "rope_theta": 10000.0,
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 256,
        },
    ],
)
def test_length_dependent_rope_is_not_shifted(rope):
    model = tiny("llama", rope, {})
    reason = rope_shift_for(model)
    assert isinstance(reason, str) and rope["rope_type"] in reason


def test_a_model_without_rope_is_not_shifted():
    from transformers import BloomConfig, BloomForCausalLM  # ALiBi

    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    reason = rope_shift_for(model)
    assert isinstance(reason, str) and "bloom" in reason


class _Restored:
    """A finished (or not yet finished) restore: every layer already in the job's pages."""

    def __init__(self, ready: bool) -> None:
        self.ready = ready

    def wait_layer(self, i: int) -> None:
        pass


@pytest.mark.parametrize(
    ("ready", "batch_bytes"), [(True, 64 << 20), (True, 2 * 20 * 2 * 2 * 16 * 4), (False, 64 << 20)]
)
def test_shifted_kv_moves_every_layer_like_a_rotation(monkeypatch, ready, batch_bytes):
    """ShiftedKV moves [src, src + n) to [keep, keep + n) in every layer, keys rotated by -shift and
    values copied, across page borders and with overlapping runs: the layers not moved yet together once
    the restore is complete (in batches within MOVE_BATCH_BYTES: here all 5, or 2 at a time), else one
    layer per wait. Nothing outside the target run changes."""
    from kvtier import KVLayout
    from local_runner import realign
    from local_runner.job_kv import JobKV

    monkeypatch.setattr(realign, "MOVE_BATCH_BYTES", batch_bytes)
    layout = KVLayout(num_layers=5, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    kv = JobKV.standalone(layout, torch.device("cpu"), capacity=48, page_tokens=16)
    buf = kv.pool.buffer
    buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(0)))
    before = buf.clone()
    found = realign.Realignment(keep=3, src=10, n=20)  # [10, 30) -> [3, 23): the runs overlap
    shift = RopeShift(inv_freq=1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)))
    shifted = realign.ShiftedKV(_Restored(ready), found, shift, kv)

    shifted.wait_layer(0)
    assert shifted._done == ({0, 1} if batch_bytes < 1 << 20 else set(range(5)) if ready else {0})
    for i in range(1, 5):
        shifted.wait_layer(i)

    src_pages, src_offsets = kv.token_slots(found.src, found.source_end)
    dst_pages, dst_offsets = kv.token_slots(found.keep, found.reused)
    for i in range(5):
        keys, values = before[i, src_pages, 0, :, src_offsets], before[i, src_pages, 1, :, src_offsets]
        assert rel_err(buf[i, dst_pages, 0, :, dst_offsets], shift.rotate(keys, -found.shift)) <= 1e-5
        assert torch.equal(buf[i, dst_pages, 1, :, dst_offsets], values)
    untouched = [t for t in range(48) if not found.keep <= t < found.reused]
    pages, offsets = kv.token_slots(0, 48)
    keep = [pages[t] for t in untouched], [offsets[t] for t in untouched]
    assert torch.equal(buf[:, keep[0], :, :, keep[1]], before[:, keep[0], :, :, keep[1]])


@pytest.mark.parametrize("rope_type", ["default", "dynamic"])
def test_a_rope_that_varies_with_the_length_takes_no_packed_step(rope_type):
    """A packed step puts every job's positions in one call, and transformers scales dynamic NTK by the
    call's largest position: a job's keys would rotate by the others' lengths. Such a model runs one job
    per forward; a fixed RoPE packs."""
    from local_runner.model_step import ModelStep
    from local_runner.rope_config import varying_rope
    from tests.tiny_model import tiny_loaded

    rope = {"rope_theta": 10000.0, "rope_type": rope_type}
    if rope_type == "dynamic":
        rope["factor"] = 2.0
    model = tiny("llama", rope, {}).float()
    assert (varying_rope(model) is not None) == (rope_type == "dynamic")
    step = ModelStep.prepare(
        tiny_loaded(model=model),
        slots=2,
        context=64,
        batch=True,
        batch_invariant=False,
        compile=False,
        max_rows=64,
    )
    assert step.packed == (rope_type == "default")
    step.pool.close()
