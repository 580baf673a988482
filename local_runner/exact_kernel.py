"""The row-invariant CPU kernels (exact_attention.cpp: attention; exact_elementwise.cpp: the step's residual
adds, norms, rotary and SiLU fused, 4 calls per layer instead of ~25; exact_linear.cpp: bfloat16 linear
layers on AMX, where the CPU has it): built once per machine with the system's C++
compiler (torch's cpp_extension; docs/benchmarks.md, "What a start costs"), kept under the engine's cache
folder, loaded in milliseconds at later starts.

Why a kernel of our own: a row's rounding must depend on its own query and keys only. torch's attention
and matrix products choose their blocking by the shape of the whole call (the chunk's length, the batch's
longest job, the number of rows), so the same token rounds differently alone, batched, or inside a prompt
chunk; exact_attention.py gets invariance out of them with padded shapes, measured per machine, at some
cost. This kernel has it by construction (one fixed loop per row) and reads each row's keys once.

Where it cannot be built (no compiler, CUDA tensors), the step uses exact_attention.py's padded calls;
the reason is logged once and shown in /healthz (`attention`).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("attnstore.runner")

# exact_attention.cpp: the attention operator; exact_elementwise.cpp: the step's norms, rotary and SiLU;
# exact_linear.cpp: bfloat16 linear layers on AMX (exact_amx.h: what it shares with the attention's;
# exact_tiles.h: the attention's tile step on AMX or AVX-512 BF16).
_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("exact_attention.cpp", "exact_elementwise.cpp", "exact_linear.cpp")
]
_lock = threading.Lock()
_kernel: Any = None
_failure: str | None = None
# Where the built kernel is kept: the runner's cache folder (settings: local_runner.cache_dir), set by
# whoever builds the runner; relative to the working directory until then.
_cache_dir = Path("var/models")


def use_cache_dir(folder: Path) -> None:
    global _cache_dir
    _cache_dir = folder


def ensure_built() -> str | None:
    """`build` into the configured cache folder."""
    return build(_cache_dir)


def machine_key() -> str:
    """What the built code depends on beyond its source (cpp_extension rebuilds when that changes): torch
    and this CPU's instruction sets (`-march=native`), so a folder shared by other machines is safe."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    digest = hashlib.sha256(f"{torch.__version__}|{flags}".encode()).hexdigest()[:12]
    return f"{platform.machine()}-{digest}"


def kernels_folder() -> Path:
    """The configured cache folder's part for what is built or measured per machine or device."""
    return _cache_dir / "kernels"


def machine_folder() -> Path:
    """The configured cache folder's part for this machine and torch (the built kernel, and what was
    measured of torch's kernels here)."""
    return kernels_folder() / machine_key()


def build(cache_dir: Path) -> str | None:
    """Build (or load the built) kernel under `cache_dir`; None when it is ready, else why not.
    Idempotent and thread-safe: the first caller builds, the others wait for it."""
    global _kernel, _failure
    with _lock:
        if _kernel is not None or _failure is not None:
            return _failure
        try:
            from torch.utils import cpp_extension

            folder = cache_dir / "kernels" / machine_key()
            folder.mkdir(parents=True, exist_ok=True)
            started = time.perf_counter()
            if not any(folder.glob("*.so")):
                log.info("building the exact attention kernel in %s (once per machine)", folder)
            # cpp_extension runs `ninja` from PATH: the one installed beside this Python comes first
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
            # One build at a time per folder, across processes, by a lock the OS releases when its holder
            # dies: cpp_extension's own (a `lock` file) outlives a builder killed mid-build, and every
            # later start would wait for it forever; under ours, such a file is stale.
            with open(folder / "attnstore-build.lock", "w") as guard:
                fcntl.flock(guard, fcntl.LOCK_EX)
                (folder / "lock").unlink(missing_ok=True)
                # A plain shared library registering torch.ops.attnstore.exact_attend (no Python module:
                # the pybind11 bindings' headers would double the build); cpp_extension loads it.
                cpp_extension.load(
                    name="attnstore_exact_attention",
                    sources=[str(source) for source in _SOURCES],
                    # -fopenmp: at::parallel_for's OpenMP region is in a header, compiled here.
                    # -std=c++20: the sources use C++20 (std::type_identity), which torch 2.13's
                    # cpp_extension passes and older ones do not (they pass c++17; the later flag wins).
                    extra_cflags=["-std=c++20", "-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(folder),
                    is_python_module=False,
                    verbose=False,
                )
            _kernel = torch.ops.attnstore.exact_attend.default
            _check_elementwise()
            log.info("exact attention kernel ready in %.1f s", time.perf_counter() - started)
        except Exception as exc:  # no compiler, no ninja, a failed build: the padded calls serve
            _failure = (str(exc).strip().split("\n")[0][:200]) or type(exc).__name__
            log.warning("exact attention kernel not built (%s): exact_attention.py's calls serve", _failure)
        return _failure


def _check_elementwise() -> None:
    """The fused elementwise operators are there (one library with the attention's): a library built
    from an older source would lack them, and the step must not find out mid-forward."""
    missing = [
        n
        for n in ("rms_norm", "add_rms_norm_", "rotary_", "silu_mul", "amx_linear")
        if not hasattr(torch.ops.attnstore, n)
    ]
    if missing:
        raise RuntimeError(f"the built kernel lacks {', '.join(missing)}")


def amx_linear_ready() -> bool:
    """Whether exact_linear.cpp's bfloat16 AMX kernel runs here (built, on a CPU with AMX)."""
    return _kernel is not None and bool(torch.ops.attnstore.amx_linear_ready())


# The head sizes exact_attention.cpp is instantiated for (a model with another runs the padded calls).
HEAD_DIMS = frozenset({16, 32, 48, 64, 80, 96, 128, 256})


def ready(head_dim: int) -> bool:
    """Whether the kernel serves a model of this head size."""
    return _kernel is not None and head_dim in HEAD_DIMS


def describe(head_dim: int) -> str:
    """The exact step's attention for a model of this head size, for /healthz."""
    if ready(head_dim):
        return "exact (kernel)"
    if _kernel is not None:
        return f"exact (padded calls: the kernel has no head size {head_dim})"
    return f"exact (padded calls: {_failure or 'kernel not built'})"


def attend(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: torch.Tensor,
    jobs: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [tokens, heads, dim]; k_pages, v_pages [pages, kv_heads, page_tokens, dim] (one layer of a page
    pool); token t attends to the first lengths[t] keys of job jobs[t], whose pages are tables[jobs[t]]
    in order; [tokens, heads, dim] out."""
    return _kernel(q, k_pages, v_pages, tables, jobs, lengths, scale)
