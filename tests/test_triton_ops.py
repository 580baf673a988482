"""The CUDA step's fused operations (local_runner/triton_ops.py) against torch's own, as decoder.py
computes them: under Triton's interpreter on a CPU, compiled on CUDA. The row-invariant product: every
row the same whatever the row count (on CUDA bit for bit; the interpreter's products are numpy's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from local_runner import kernel_choice, triton_ops  # noqa: E402
from local_runner.decoder import _rms_norm, _rotate  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# The interpreter rounds float32 to bfloat16 by truncation: bfloat16 is checked on CUDA only.
ELEMENTWISE = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", ELEMENTWISE)
def test_rms_norm_and_the_residual_add_are_torchs(dtype):
    x, delta, w = _rand(5, 96, dtype=dtype), _rand(5, 96, dtype=dtype, seed=1), _rand(96, dtype=dtype, seed=2)
    torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-5), _rms_norm(x, w, 1e-5), atol=5e-2, rtol=2e-2)
    want_x = x + delta
    got = triton_ops.add_rms_norm_(x, delta, w, 1e-5)
    assert torch.equal(x, want_x)  # the add rounds as torch's does
    torch.testing.assert_close(got, _rms_norm(want_x, w, 1e-5), atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", ELEMENTWISE)
def test_rotary_in_place_is_transformers(dtype):
    heads, kv_heads, dim, tokens = 4, 2, 32, 6
    qkv = _rand(tokens, heads + 2 * kv_heads, dim, dtype=dtype)
    angles = torch.arange(50.0)[:, None] * (1e-2 * torch.arange(1, dim // 2 + 1))[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    positions = torch.tensor([3, 4, 5, 40, 0, 49], device=DEVICE)
    want = qkv.clone()
    want[:, : heads + kv_heads] = _rotate(
        qkv[:, : heads + kv_heads], cos[positions][:, None], sin[positions][:, None]
    )
    triton_ops.rotary_(qkv, cos, sin, positions, heads + kv_heads)
    assert torch.equal(qkv, want)


@pytest.mark.parametrize("dtype", ELEMENTWISE)
def test_silu_mul_is_torchs(dtype):
    gate_up = _rand(3, 2 * 1500, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(triton_ops.silu_mul(gate_up), F.silu(gate) * up, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("config", kernel_choice.LINEAR_CANDIDATES, ids=kernel_choice.config_name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else []))
def test_the_invariant_product_is_a_product_whatever_the_row_count(dtype, config):
    """In every candidate config (kernel_choice.py picks one per model and device)."""
    w = _rand(200, 160, dtype=dtype, seed=3)
    x = _rand(70, 160, dtype=dtype, seed=4)
    whole = triton_ops.linear(x, w, config)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        whole.float(), (x.float() @ w.float().T).to(dtype).float(), atol=tolerance, rtol=tolerance
    )
    for rows in (1, 3, 17):
        part = triton_ops.linear(x[:rows].contiguous(), w, config)
        if CUDA:
            assert torch.equal(part, whole[:rows]), rows
        else:
            torch.testing.assert_close(part, whole[:rows], atol=tolerance, rtol=tolerance)


def test_a_device_where_kernels_run_says_so_and_one_where_they_cannot_says_why(monkeypatch):
    """The engine asks before it builds its CUDA step on these kernels (else transformers' forward)."""
    device = torch.device(DEVICE)
    assert triton_ops.launch_failure(device, torch.float32) is None

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to compile the launcher: gcc: not found\nfull log ...")

    monkeypatch.setattr(triton_ops, "rms_norm", no_compiler)
    reason = triton_ops.launch_failure(device, torch.float32)
    assert reason == "Triton cannot run a kernel here: Failed to compile the launcher: gcc: not found"
