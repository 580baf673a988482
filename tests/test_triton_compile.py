"""The CUDA step's Triton kernels compiled for sm_90 (H100, H200) on this CPU, as each launch of a layer
would compile them (bench/gpu/triton_aot.py): the interpreter the other Triton tests run under never
compiles, so a kernel could pass them and fail on a device, or spill its registers, outgrow an SM's
shared memory, or lose its tensor cores or its pipelined loads, each found here only by a device
session. Against the Triton this project pins for its tests (the Makefile's TRITON_PIN)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

pytest.importorskip("triton")

from bench.gpu import triton_aot  # noqa: E402

pytestmark = pytest.mark.skipif(triton_aot.available() is not None, reason=str(triton_aot.available()))

SM90_SHARED = triton_aot.SHARED_PER_BLOCK[90]
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_launch_of_a_layer_compiles_for_sm90_without_spilling(dtype: str) -> None:
    """Compiled in a process of its own: Triton imported under TRITON_INTERPRET (as in this session)
    decorates its own library for the interpreter and cannot compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu.triton_aot",
            "--engine",
            "--json",
            "--arch",
            "90",
            "--dtype",
            dtype,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    built = [orjson.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    names = [b["name"] for b in built]
    assert names == [
        "attention",
        "merge",
        "attention, decode graph",
        "merge",
        "linear",
        "rms_norm",
        "rotary",
        "silu_mul",
    ]
    for b in built:
        assert "failed" not in b, b
        assert b["spill_bytes"] == 0, b
        assert b["shared_bytes"] <= SM90_SHARED, b
        if b["name"].startswith("attention") or b["name"] == "linear":
            assert b["async_copies"], b  # key and weight blocks loaded ahead of their use, not waited for
            # 16-bit products on tensor cores; float32's, in IEEE float32, are FMAs (dot_precision)
            assert b["tensor_core"] == (dtype != "float32"), b
    # the rotary rounds each product, then their sum, as torch does (enable_fp_fusion=False): a fused
    # multiply-add would round a float32 product and sum once
    rotary = next(b for b in built if b["name"] == "rotary")
    assert rotary["float32_fmas"] == 0, rotary


def test_the_specialization_follows_the_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pointers 16-byte aligned and integers divisible by 16 carry Triton's divisibility hint, which is
    what lets its pipeliner issue vectorized async copies; an integer of 1 is a constant; the
    arguments a kernel says not to specialize (the page-table width, the partitions) stay plain."""
    launch = next(x for x in triton_aot.engine_launches(torch.bfloat16, ops=False) if x.name == "attention")
    signature, constexprs, attrs = triton_aot._specialize(launch)
    names = list(signature)
    hinted = {names[i] for (i,) in attrs}
    assert {"Q", "K", "V", "Out", "tables", "stride_kt"} <= hinted
    assert "stride_table" not in hinted and "partitions" not in hinted
    assert signature["Q"] == "*bf16" and signature["tables"] == "*i32" and signature["scale_log2"] == "fp32"
    assert constexprs["BLOCK_M"] == 64 and constexprs["GROUP"] == 4
