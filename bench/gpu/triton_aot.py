"""The engine's Triton kernels compiled for a GPU on a machine without one: what each launch of the CUDA
step would compile, taken from the engine's own wrappers, built to machine code for an NVIDIA target
by Triton's compiler and the ptxas its wheel ships, and read back (registers, spills, shared memory,
tensor-core and async-copy instructions).

Why: the tests run these kernels under Triton's interpreter on a CPU, which executes Python over numpy
and never runs the compiler: a kernel can pass there and fail to compile for a GPU, spill its
registers, ask for more shared memory than an SM has, or lose its software pipelining. A device session
is rare and short; this finds those here.

    python -m bench.gpu.triton_aot [--arch 90] [--dtype bfloat16]

prints one line per launch and config: the engine's configs and those bench/gpu/kernels.py times.

How a launch is taken: the wrappers (triton_attention.attend, triton_ops.linear, rms_norm, rotary_,
silu_mul) run on CPU tensors with their kernels replaced by recorders, which keep the arguments and
launch options instead of launching. Each argument is then specialized by Triton's own code, as its JIT
does at a launch (a tensor is a pointer to its dtype, 16-byte aligned or not; an integer is a constant
where it is 1, divisible by 16 or not, unless the kernel says not to specialize it; a float is fp32).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import orjson
import torch

from bench.gpu.configs import LINEAR_CONFIGS, attention_configs
from local_runner import triton_attention as ta
from local_runner import triton_ops

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

# What an SM offers a block on each target (opt-in shared memory per block, bytes).
SHARED_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclass
class Launch:
    """One kernel launch as the wrapper made it."""

    name: str
    kernel: Any  # the JITFunction
    args: dict[str, Any]  # by parameter name
    options: dict[str, Any]  # num_warps, num_stages, enable_fp_fusion


@dataclass
class Built:
    """A launch compiled: what the machine code asks of an SM, and which instructions it uses."""

    launch: Launch
    registers: int
    spill_bytes: int  # stack and local memory per thread: registers spilled
    shared_bytes: int
    tensor_core: bool  # wgmma (sm_90) or mma
    async_copies: bool  # cp.async or TMA: loads pipelined ahead of their use
    float32_fmas: int  # fma.rn.f32 instructions: a product and a sum rounded once, not twice


class _Recorder:
    """Stands for a JITFunction in a wrapper: `kernel[grid](*args, **kwargs)` records, launches nothing."""

    def __init__(self, name: str, kernel: Any, launches: list[Launch]) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            names = [p.name for p in self.kernel.params]
            options: dict[str, Any] = {
                k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs
            }
            bound = dict(zip(names, args, strict=False)) | kwargs
            self.launches.append(Launch(self.name, self.kernel, bound, options))

        return record


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Within: the engine's Triton wrappers record their launches into the list yielded."""
    launches: list[Launch] = []
    attention, ops = _compilable(ta._kernels), _compilable(triton_ops._kernels)

    def wrap(kernels: Any) -> Any:
        fields = {
            f.name: _Recorder(f.name, getattr(kernels, f.name), launches) for f in dataclasses.fields(kernels)
        }
        return type(kernels)(**fields)

    with (
        mock.patch.object(ta, "_kernels", lambda: wrap(attention)),
        mock.patch.object(triton_ops, "_kernels", lambda: wrap(ops)),
    ):
        yield launches


def _compilable(kernels: Any) -> Any:
    """The module's kernels decorated anew as JIT functions: its own are decorated once, for Triton's
    interpreter where TRITON_INTERPRET is set (the tests on a CPU), and say nothing of their params."""
    with mock.patch.dict(os.environ):
        os.environ.pop("TRITON_INTERPRET", None)
        return kernels.__wrapped__()


def engine_launches(
    dtype: torch.dtype,
    attention: ta.AttentionConfig | None = None,
    linear: triton_ops.LinearConfig = triton_ops.ENGINE_LINEAR,
    ops: bool = True,
) -> list[Launch]:
    """The launches of one layer of a CUDA step at the 8B shape (32 heads, 8 K/V heads of 128, 4,096
    wide, pages of 256): a prompt chunk and a decoding token beside it, one row past a partition (the
    merge), a decode graph's step, the invariant product, and the row-wise operations. `attention`: the engine's config for
    `dtype` where None."""
    attention = attention or ta.config_for(dtype)
    heads, kv_heads, dim, page, hidden = 32, 8, 128, 256, 4096
    pages = -(-(ta.PARTITION + 8) // page) + 1
    pool = torch.empty(pages, 2, kv_heads, page, dim, dtype=dtype)
    k, v = pool[:, 0], pool[:, 1]
    with recording() as launches:
        tables = torch.arange(pages - 1, dtype=torch.int32).reshape(1, -1).repeat(2, 1)
        lengths = [ta.PARTITION + 8] + [30 + i for i in range(20)]  # job 0 decodes past a partition
        meta = ta.plan(tables, [0] + [1] * 20, lengths, heads, kv_heads, attention)
        ta.attend(torch.empty(21, heads, dim, dtype=dtype), k, v, meta, dim**-0.5)
        # a decode graph's plan, as cuda_graphs.py makes it: one item per row, partitions for the
        # longest context the graphs serve
        rows = torch.arange(8, dtype=torch.int32)
        lengths_8 = torch.full((8,), 100, dtype=torch.int32)
        graph_meta = ta.KernelPlan(
            tables=tables.repeat(4, 1),
            lengths=lengths_8,
            item_job=rows,
            item_row=rows,
            item_count=torch.ones(8, dtype=torch.int32),
            item_length=lengths_8,
            items=8,
            partitions=ta.partitions_of(ta.PARTITION + 8),
            group=heads // kv_heads,
            tokens=8,
            config=attention,
        )
        ta.attend(torch.empty(8, heads, dim, dtype=dtype), k, v, graph_meta, dim**-0.5)
        graph_launch = next(x for x in reversed(launches) if x.name == "attention")
        graph_launch.name = "attention, decode graph"
        triton_ops.linear(torch.empty(3, hidden, dtype=dtype), torch.empty(6144, hidden, dtype=dtype), linear)
        if ops:
            x = torch.empty(3, hidden, dtype=dtype)
            triton_ops.add_rms_norm_(x, torch.empty_like(x), torch.empty(hidden, dtype=dtype), 1e-5)
            qkv = torch.empty(3, heads + 2 * kv_heads, dim, dtype=dtype)
            cos = torch.empty(64, dim, dtype=dtype)
            triton_ops.rotary_(qkv, cos, torch.empty_like(cos), torch.arange(3), heads + kv_heads)
            triton_ops.silu_mul(torch.empty(3, 2 * 14336, dtype=dtype))
    return launches


def _specialize(launch: Launch) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], list]]:
    """signature, constexprs and attrs for ASTSource, as Triton's JIT specializes these arguments at a
    launch: by Triton's own specialization (what JITFunction.run calls; the NVIDIA backend keeps
    BaseBackend's rules), with each parameter's do_not_specialize."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, param in enumerate(launch.kernel.params):
        value = launch.args[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        kind, key = native_specialize_impl(
            BaseBackend, value, False, not param.do_not_specialize, not param.do_not_specialize_on_alignment
        )
        signature[param.name] = kind
        if kind == "constexpr":  # an integer of 1
            constexprs[param.name] = key
        elif isinstance(key, str) and (hint := BaseBackend.parse_attr(key)):
            attrs[(i,)] = hint
    return signature, constexprs, attrs


def build(launch: Launch, arch: int = 90) -> Built:
    """Compile a launch for sm_`arch` down to a cubin and read what it asks of the SM."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    signature, constexprs, attrs = _specialize(launch)
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("TRITON_INTERPRET is set: Triton compiles nothing in this process (run main())")
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=launch.options)
    usage = _resource_usage(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    return Built(
        launch=launch,
        registers=usage["REG"],
        spill_bytes=usage["STACK"] + usage["LOCAL"],
        shared_bytes=compiled.metadata.shared,
        tensor_core="wgmma.mma_async" in ptx or "mma.sync" in ptx,
        async_copies="cp.async" in ptx,
        float32_fmas=ptx.count("fma.rn.f32"),
    )


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, LOCAL, SHARED of the cubin's one function (cuobjdump, from Triton's wheel)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run(
            [_cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    fields = dict(part.split(":", 1) for part in line.split() if ":" in part)
    return {key: int(fields[key]) for key in ("REG", "STACK", "LOCAL", "SHARED")}


@functools.cache
def _cuobjdump() -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def available() -> str | None:
    """None where kernels can be built for an NVIDIA target here, else why not."""
    if triton is None:
        return "Triton is not installed"
    if not os.access(_cuobjdump(), os.X_OK):
        return "Triton's wheel has no cuobjdump"
    return None


def describe(built: Built) -> str:
    tiles = " ".join(
        f"{k}={v}" for k, v in built.launch.args.items() if k.startswith("BLOCK_") and k != "BLOCK_D"
    )
    options = " ".join(f"{k}={v}" for k, v in built.launch.options.items())
    return (
        f"{built.launch.name:<10} {tiles:<36} {options:<28} regs {built.registers:>3}"
        f"  spills {built.spill_bytes:>4} B  shared {built.shared_bytes / 1024:6.1f} KiB"
        f"  tensor cores {'yes' if built.tensor_core else 'no'}  async copies {'yes' if built.async_copies else 'no'}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="sm_ARCH (90: H100, H200)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--engine", action="store_true", help="the engine's configs only")
    ap.add_argument(
        "--json", action="store_true", help="one JSON object a launch (tests/test_triton_compile.py)"
    )
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):  # Triton imported under it compiles nothing: start afresh
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(
            sys.executable, [sys.executable, "-m", "bench.gpu.triton_aot", *(argv or sys.argv[1:])], env
        )
    why = available()
    if why:
        print(why)
        return 1
    dtype = getattr(torch, args.dtype)
    launches = engine_launches(dtype)  # the engine's configs: every launch of a layer
    if not args.engine:  # then each other config, its own kernel only
        for attention in attention_configs(dtype)[1:]:
            launches += [
                x for x in engine_launches(dtype, attention=attention, ops=False) if x.name == "attention"
            ]
        for linear in LINEAR_CONFIGS[1:]:
            launches += [x for x in engine_launches(dtype, linear=linear, ops=False) if x.name == "linear"]
    if not args.json:
        shared = SHARED_PER_BLOCK.get(args.arch, 0) / 1024
        print(
            f"Triton {triton.__version__}, sm_{args.arch}, {args.dtype}; shared memory a block may take: {shared:.0f} KiB"
        )
    for launch in launches:
        try:
            built = build(launch, args.arch)
        except Exception as exc:  # a launch that does not compile: say so, go on
            failed = str(exc).splitlines()[0][:300]
            print(
                orjson.dumps({"name": launch.name, "failed": failed}).decode()
                if args.json
                else f"{launch.name:<10} {launch.options}: FAILED: {failed}"
            )
            continue
        if args.json:
            fields = {f.name: getattr(built, f.name) for f in dataclasses.fields(built) if f.name != "launch"}
            print(orjson.dumps(fields | {"name": launch.name, "options": launch.options}).decode())
        else:
            print(describe(built))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
