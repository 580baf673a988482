"""The CUDA step's fused row-wise operations and its row-invariant matrix product, in Triton.

Why fused: a decode step of a large model is a few hundred kernels; every launch that a fusion saves is
time no step waits for (and a CUDA graph replays fewer nodes). Each operation here is what the CPU's
exact_elementwise.cpp does: the residual add with the RMSNorm after it, q and k rotated in place in the
fused projection's output, SiLU times up. Each row is computed by one program with one fixed loop, so a
row's bits never depend on the other rows of the call; the roundings are torch's, operation for
operation (bfloat16 results rounded where transformers' forward rounds them).

`linear` is the row-invariant matrix product of `batch_invariant` on CUDA: one tile shape for every
call, the reduction over K in fixed blocks from 0 with no split, so a row's result is the same however
many rows share the call (cuBLAS picks its kernel, and so its reduction order, by the row count).

On a CPU these kernels run under TRITON_INTERPRET=1 for the tests (decorated at first use).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .compiled import first_line
from .triton_attention import dot_precision

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None


@dataclass(frozen=True)
class LinearConfig:
    """The invariant product's tile and pipeline: one for every call of a model (see the module
    docstring; a row's sums over K follow BLOCK_K and the MMA shape the tile gives). The defaults are
    the engine's first guess; at a model's first start on a device the engine times the alternatives
    against cuBLAS and keeps the fastest (kernel_choice.py)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4


ENGINE_LINEAR = LinearConfig()


def available() -> bool:
    return triton is not None


def launch_failure(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when a Triton kernel compiles and runs on `device`, else why not. Importing Triton proves
    little: its first launch compiles a launcher with the machine's C compiler against Python's headers,
    which a slim image may lack; the engine asks before it builds a packed step on Triton's kernels."""
    try:
        x = torch.ones(1, 16, dtype=dtype, device=device)
        out = rms_norm(x, torch.ones(16, dtype=dtype, device=device), 1e-6)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if not torch.isfinite(out.float()).all():
            return "Triton's RMSNorm gave a non-finite result on ones"
    except Exception as exc:  # any failure to compile or launch
        return f"Triton cannot run a kernel here: {first_line(exc)}"
    return None


# ---- kernels (decorated at first use: _kernels) ----------------------------------------------------------


def _rms_norm_kernel(
    X, Delta, W, Out, stride_x, stride_d, stride_o, n, eps, ADD: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:  # x += delta, rounded to x's dtype as torch's addition rounds, written back
        d = tl.load(Delta + row * stride_d + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(X + row * stride_x + cols, x, mask=ok)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / n
    h = (h * tl.rsqrt(variance + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    y = (w.to(tl.float32) * h.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + cols, y, mask=ok)


def _rotary_kernel(
    QKV, Cos, Sin, positions, stride_t, stride_h, stride_cos, HALF: tl.constexpr, BLOCK: tl.constexpr
):
    """One (token, head) per program: x * cos + rotate_half(x) * sin, each product and the sum rounded to
    x's dtype (transformers' apply_rotary_pos_emb in that dtype)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(positions + token).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    base = QKV + token * stride_t + head * stride_h
    x1 = tl.load(base + i, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + i, mask=ok, other=0.0)
    c1 = tl.load(Cos + pos * stride_cos + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + pos * stride_cos + HALF + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + pos * stride_cos + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + pos * stride_cos + HALF + i, mask=ok, other=0.0).to(tl.float32)
    dtype = QKV.dtype.element_ty
    a1 = (x1.to(tl.float32) * c1).to(dtype)
    b1 = ((-x2.to(tl.float32)) * s1).to(dtype)
    a2 = (x2.to(tl.float32) * c2).to(dtype)
    b2 = (x1.to(tl.float32) * s2).to(dtype)
    tl.store(base + i, (a1.to(tl.float32) + b1.to(tl.float32)).to(dtype), mask=ok)
    tl.store(base + HALF + i, (a2.to(tl.float32) + b2.to(tl.float32)).to(dtype), mask=ok)


def _silu_mul_kernel(GU, Out, stride_g, stride_o, n, BLOCK: tl.constexpr):
    """out = silu(gate) * up for one row of [gate | up]; silu rounded to the dtype first (torch's F.silu
    in that dtype), then the product."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(GU + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_g + n + cols, mask=ok, other=0.0)
    dtype = Out.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dtype)
    tl.store(Out + row * stride_o + cols, (s.to(tl.float32) * u.to(tl.float32)).to(dtype), mask=ok)


def _linear_kernel(
    X,
    W,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Out[m, n] = sum_k X[m, k] W[n, k], K in blocks of BLOCK_K from 0, accumulated in float32."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            X + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
        )
        w = tl.load(
            W + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0
        )
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    tl.store(
        Out + rm[:, None] * stride_om + rn[None, :],
        acc.to(Out.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@dataclass(frozen=True)
class _Kernels:
    rms_norm: Any
    rotary: Any
    silu_mul: Any
    linear: Any


@functools.cache
def _kernels() -> _Kernels:
    return _Kernels(
        rms_norm=triton.jit(_rms_norm_kernel),
        rotary=triton.jit(_rotary_kernel),
        silu_mul=triton.jit(_silu_mul_kernel),
        linear=triton.jit(_linear_kernel, do_not_specialize=["M"]),  # the row count: no compile per M
    )


# ---- the operations --------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm of each row of x ([rows, hidden])."""
    out = torch.empty_like(x)
    _norm(x, None, weight, eps, out)
    return out


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta (in place), then the RMSNorm of the new x: the residual add and the norm after it."""
    out = torch.empty_like(x)
    _norm(x, delta, weight, eps, out)
    return out


def _norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    rows, n = x.shape
    assert x.stride(1) == 1 and out.stride(1) == 1
    d = delta if delta is not None else x
    _kernels().rms_norm[(rows,)](
        x,
        d,
        weight,
        out,
        x.stride(0),
        d.stride(0),
        out.stride(0),
        n,
        eps,
        ADD=delta is not None,
        BLOCK=triton.next_power_of_2(n),
        num_warps=_warps(n),
    )


def rotary_(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, heads: int
) -> None:
    """Rotate the first `heads` heads of qkv ([tokens, all heads, head_dim]: q's then k's) in place, each
    token at its position; cos and sin [positions, head_dim] (the model's rotary cache)."""
    tokens, _, dim = qkv.shape
    assert qkv.stride(2) == 1 and cos.stride(1) == 1
    _kernels().rotary[(tokens, heads)](
        qkv,
        cos,
        sin,
        positions,
        qkv.stride(0),
        qkv.stride(1),
        cos.stride(0),
        HALF=dim // 2,
        BLOCK=triton.next_power_of_2(dim // 2),
        num_warps=1,
        # each product rounded, then the sum, as torch does; fused into one FMA (Triton's default) a
        # float32 sum skips the products' rounding (16-bit ones are rounded between, so never fused)
        enable_fp_fusion=False,
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of each row of [gate | up] ([rows, 2 * n]): [rows, n]."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _kernels().silu_mul[(rows, triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, config: LinearConfig = ENGINE_LINEAR) -> torch.Tensor:
    """x [rows, K] @ weight [N, K]^T, each row computed the same way whatever the row count."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    _kernels().linear[grid](
        x,
        weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _warps(n: int) -> int:
    return 8 if n >= 4096 else 4 if n >= 1024 else 2
