"""The engine's Triton kernels timed on the device, each in a few configs, beside torch's own on the same
data: the paged attention against SDPA's causal attention over the same keys laid out whole (the
bound a paged kernel works towards), and the invariant product (`batch_invariant`) against cuBLAS.

Why: a config (tiles, warps, pipeline stages) is one for every launch of a process (a row's sums follow
it: triton_attention.AttentionConfig), so it is chosen once, by measuring on the kind of device it
serves; this prints what that choice needs, the engine's config first and every ratio against it.

    python -m bench.gpu.kernels [--shape 8b] [--reps 5] [--out kernels.jsonl]

Prints, for the model shape's one layer:
- prefill: a causal prompt of 8k / 16k / 22k tokens in steps of 8,192 (the check's max_batch_tokens),
  ms and TFLOP/s of the paged kernel per config, and SDPA's on the whole prompt at once;
- decode: 1 / 8 / 32 jobs of one token at 1k and 8k keys, microseconds and the GB/s of keys and values
  read;
- linear: the layer's four products (q/k/v, o, gate/up, down) at 1 to 8,192 rows, ms per config and
  its ratio to cuBLAS (issue 36 allows the invariant step 15% over the fastest).
A config that cannot launch (shared memory, registers) says why and is left out. On a CPU it runs under
Triton's interpreter at `--shape tiny` (tests/test_gpu_check.py): the code path, no figure worth reading.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before Triton's kernels are decorated (at first use)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.gpu.configs import LINEAR_CONFIGS, attention_configs  # noqa: E402
from local_runner import kernel_choice, triton_ops  # noqa: E402
from local_runner import triton_attention as ta  # noqa: E402
from local_runner.compiled import first_line  # noqa: E402


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    page_tokens: int
    prompts: tuple[int, ...]  # prefill lengths
    step_tokens: int  # a prefill step's tokens
    decode_jobs: tuple[int, ...]
    decode_keys: tuple[int, ...]
    rows: tuple[int, ...]  # the products' row counts


SHAPES = {
    "8b": Shape(32, 8, 128, 4096, 14336, 256, (8192, 16384, 22528), 8192, (1, 8, 32), (1024, 8192),
                (1, 8, 32, 256, 8192)),
    "135m": Shape(9, 3, 64, 576, 1536, 256, (8192, 16384), 8192, (1, 8, 32), (1024, 8192), (1, 32, 8192)),
    "tiny": Shape(4, 2, 32, 64, 128, 64, (200,), 128, (1, 2), (100,), (1, 8)),
}  # fmt: skip


def timed(fn: Callable[[], Any], reps: int, calls: int = 1) -> float:
    """The engine's own timing of a config (a CUDA graph's replays, the median of `reps`)."""
    return kernel_choice.timed(fn, calls, reps)


def against(seconds: float, reference: float | None, what: str = "the engine's") -> str:
    """`seconds` as a ratio of the reference's, where it ran."""
    return f"  x{seconds / reference:.2f} of {what}" if reference else ""


def config_name(config: Any) -> str:
    return config_name_of(asdict(config))


def config_name_of(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items())


def _geomean(values: list[float]) -> float:
    return float(statistics.geometric_mean(values))


class Report:
    """Each figure as a JSON line (--out) and in memory, for the summary."""

    def __init__(self, out: str | None) -> None:
        self._file = open(out, "wb") if out else None  # noqa: SIM115 - closed in close()
        self.rows: list[dict[str, Any]] = []

    def row(self, **fields: Any) -> None:
        self.rows.append(fields)
        if self._file:
            self._file.write(orjson.dumps(fields) + b"\n")
            self._file.flush()

    def summary(self) -> list[str]:
        """The choice the figures support: for the attention, the config whose time is least against
        the engine's (the geometric mean of its ratios over every prompt and decode point), among those
        that ran and agreed everywhere; for the invariant product, each config against cuBLAS (the
        geometric mean and the worst, issue 36's bound being 1.15)."""
        lines = []
        attention = [r for r in self.rows if r["kind"] in ("prefill", "decode") and r["config"] != "sdpa"]
        engine = {self._point(r): r["seconds"] for r in attention if r.get("engine")}
        ratios: dict[str, list[float]] = {}
        spoiled: set[str] = set()
        for r in attention:
            name = config_name_of(r["config"])
            if "failed" in r or r.get("differs"):
                spoiled.add(name)
            elif self._point(r) in engine:
                ratios.setdefault(name, []).append(r["seconds"] / engine[self._point(r)])
        whole = {n: v for n, v in ratios.items() if n not in spoiled and len(v) == len(engine)}
        lines += [f"attention: {name}: failed or differed somewhere (left out)" for name in sorted(spoiled)]
        if whole:
            best = min(whole, key=lambda n: _geomean(whole[n]))
            lines.append(
                f"attention: fastest config that ran and agreed everywhere: {best}, x{_geomean(whole[best]):.2f}"
                f" of the engine's (geometric mean over {len(engine)} points; worst x{max(whole[best]):.2f})"
            )
        linear = [r for r in self.rows if r["kind"] == "linear"]
        torch_s = {r["rows"]: r["seconds"] for r in linear if isinstance(r["config"], str) and "seconds" in r}
        by_config: dict[str, list[float]] = {}
        broken: set[str] = set()
        for r in linear:
            if isinstance(r["config"], str):
                continue
            name = config_name_of(r["config"])
            if "failed" in r or r.get("differs"):
                broken.add(name)
            elif r["rows"] in torch_s:
                by_config.setdefault(name, []).append(r["seconds"] / torch_s[r["rows"]])
        lines += [
            f"linear: {name}: failed or differed at some row count (left out)" for name in sorted(broken)
        ]
        complete = {n: v for n, v in by_config.items() if n not in broken and len(v) == len(torch_s)}
        for name, values in sorted(complete.items(), key=lambda item: _geomean(item[1])):
            lines.append(
                f"linear: {name}: x{_geomean(values):.2f} of torch's product (geometric mean over"
                f" {len(values)} row counts), worst x{max(values):.2f}"
            )
        return lines

    @staticmethod
    def _point(r: dict[str, Any]) -> tuple:
        return (r["kind"], r.get("tokens"), r.get("jobs"), r.get("keys"))

    def close(self) -> None:
        if self._file:
            self._file.close()


def pool(
    shape: Shape, tokens: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A layer of a page pool holding `tokens` keys, its pages in a shuffled order (as a pool that has
    served a while hands them out): k, v [pages, kv_heads, page_tokens, dim] and the page count."""
    pages = -(-tokens // shape.page_tokens)
    buf = torch.randn(pages, 2, shape.kv_heads, shape.page_tokens, shape.head_dim, device=device).to(dtype)
    return buf[:, 0], buf[:, 1], pages


@dataclass
class Baseline:
    """The engine's config's figure at one point, which the other configs are compared with."""

    seconds: float | None = None
    out: torch.Tensor | None = None
    what: str = "the engine's"  # what the ratios are of

    def record(
        self,
        report: Report,
        point: dict[str, Any],
        name: str,
        run: Callable[[], torch.Tensor],
        seconds: float | str,
        is_engine: bool,
        figure: Callable[[float], str],
    ) -> None:
        """One config's figure at a point (or why it failed): printed with its ratio to the engine's
        and whether its output agrees with the engine's, and reported."""
        if isinstance(seconds, str):
            print(f"{name}: failed: {seconds}")
            report.row(**point, failed=seconds)
            return
        out = run()
        if is_engine:
            self.seconds, self.out = seconds, out
        differs = agrees(out, self.out)
        print(f"{name}: {figure(seconds)}{against(seconds, self.seconds, self.what)}{differs}")
        report.row(**point, seconds=seconds, engine=is_engine, differs=bool(differs))


def prefill_figure(flops: float, seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms {flops / seconds / 1e12:7.1f} TFLOP/s"


def linear_figure(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f} ms"


def decode_figure(read: int, seconds: float) -> str:
    return f"{seconds * 1e6:8.1f} us {read / seconds / 1e9:7.1f} GB/s"


def prefill(shape: Shape, dtype: torch.dtype, device: str, reps: int, report: Report) -> None:
    scale = shape.head_dim**-0.5
    for length in shape.prompts:
        k, v, pages = pool(shape, length, dtype, device)
        table = torch.randperm(pages, device="cpu").to(torch.int32)[None].to(device)
        q = torch.randn(length, shape.heads, shape.head_dim, device=device).to(dtype)
        flops = 4 * shape.head_dim * shape.heads * length * (length + 1) / 2
        steps = range(0, length, shape.step_tokens)
        base = Baseline()
        configs = attention_configs(dtype)
        for config in configs:
            plans = [
                ta.plan(
                    table,
                    [0] * min(shape.step_tokens, length - s),
                    list(range(s + 1, min(s + shape.step_tokens, length) + 1)),
                    shape.heads,
                    shape.kv_heads,
                    config,
                )
                for s in steps
            ]
            run = functools.partial(chunks, q, k, v, plans, scale)
            base.record(
                report,
                {"kind": "prefill", "tokens": length, "config": asdict(config), "flops": flops},
                f"  prefill {length:>6}  {config_name(config)}",
                run,
                attempt(run, reps),
                config is configs[0],
                functools.partial(prefill_figure, flops),
            )
        whole = whole_prompt(shape, k, v, table, length, dtype)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        seconds = attempt(functools.partial(sdpa, *whole, is_causal=True), reps)
        if isinstance(seconds, str):
            print(f"  prefill {length:>6}  SDPA: failed: {seconds}")
        else:
            print(
                f"  prefill {length:>6}  SDPA, keys whole, one call: {seconds * 1e3:8.2f} ms"
                f" {flops / seconds / 1e12:7.1f} TFLOP/s{against(seconds, base.seconds)}"
            )
            report.row(kind="prefill", tokens=length, config="sdpa", seconds=seconds, flops=flops)
        del k, v, q, whole


def chunks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plans: list[ta.KernelPlan], scale: float
) -> torch.Tensor:
    """A prompt's steps, one launch each (one layer's worth); the last step's output."""
    start = 0
    for meta in plans:
        out = ta.attend(q[start : start + meta.tokens], k, v, meta, scale)
        start += meta.tokens
    return out


def agrees(out: torch.Tensor, reference: torch.Tensor | None) -> str:
    """Nothing where `out` is the reference's within a 16-bit rounding, else a warning for the line: a
    config that is fast but wrong is no choice."""
    if reference is None or torch.allclose(out.float(), reference.float(), atol=2e-2, rtol=2e-2):
        return ""
    return "  DIFFERS from the reference"


def whole_prompt(
    shape: Shape, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same keys gathered out of their pages, each K/V head repeated for its query heads: SDPA's
    [1, heads, tokens, dim] q, k, v."""
    order = table[0].long()
    group = shape.heads // shape.kv_heads

    def whole(pages: torch.Tensor) -> torch.Tensor:
        x = pages[order].transpose(0, 1).reshape(shape.kv_heads, -1, shape.head_dim)[:, :length]
        return x.repeat_interleave(group, dim=0)[None].contiguous()

    q = torch.randn(1, shape.heads, length, shape.head_dim, device=k.device).to(dtype)
    return q, whole(k), whole(v)


# A decode step reads each layer's keys once: the timed launches cycle through enough copies of the
# pool (standing for layers) that none is still in the GPU's L2 (50-60 MB) when it is read again.
L2_FLUSH_BYTES = 256 << 20


def decode(shape: Shape, dtype: torch.dtype, device: str, reps: int, report: Report) -> None:
    scale = shape.head_dim**-0.5
    element = torch.finfo(dtype).bits // 8
    for keys in shape.decode_keys:
        per_job = -(-keys // shape.page_tokens)
        for jobs in shape.decode_jobs:
            layers = []
            for _ in range(32):
                k, v, pages = pool(shape, keys * jobs, dtype, device)
                layers.append((k, v))
                if not CUDA or len(layers) * 2 * k.numel() * element >= L2_FLUSH_BYTES:
                    break
            tables = torch.randperm(pages).to(torch.int32).reshape(jobs, per_job).to(device)
            q = torch.randn(jobs, shape.heads, shape.head_dim, device=device).to(dtype)
            read = 2 * jobs * keys * shape.kv_heads * shape.head_dim * element
            base = Baseline()
            configs = attention_configs(dtype)
            for config in configs:
                meta = ta.plan(tables, list(range(jobs)), [keys] * jobs, shape.heads, shape.kv_heads, config)
                run = functools.partial(each_layer, q, layers, meta, scale)
                base.record(
                    report,
                    {"kind": "decode", "jobs": jobs, "keys": keys, "config": asdict(config), "bytes": read},
                    f"  decode {jobs:>2} jobs x {keys:>5} keys  {config_name(config)}",
                    run,
                    attempt(run, reps, calls=len(layers)),
                    config is configs[0],
                    functools.partial(decode_figure, read),
                )
            del layers, q


def each_layer(
    q: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]], meta: ta.KernelPlan, scale: float
) -> torch.Tensor:
    """One decode step's attention over each layer's pool in turn; the last layer's output."""
    for k, v in layers:
        out = ta.attend(q, k, v, meta, scale)
    return out


def linear(shape: Shape, dtype: torch.dtype, device: str, reps: int, report: Report) -> None:
    products = {
        "qkv": ((shape.heads + 2 * shape.kv_heads) * shape.head_dim, shape.hidden),
        "o": (shape.hidden, shape.heads * shape.head_dim),
        "gate_up": (2 * shape.intermediate, shape.hidden),
        "down": (shape.hidden, shape.intermediate),
    }
    weights = {
        name: torch.randn(n, k, device=device).to(dtype) * k**-0.5 for name, (n, k) in products.items()
    }
    for rows in shape.rows:
        xs = {name: torch.randn(rows, k, device=device).to(dtype) for name, (_, k) in products.items()}

        pairs = [(xs[name], w) for name, w in weights.items()]
        torch_product = functools.partial(products_of, torch.nn.functional.linear, pairs)
        cublas = attempt(torch_product, reps)
        label = "cuBLAS" if CUDA else "torch"
        if isinstance(cublas, str):
            print(f"  linear {rows:>5} rows  {label}: failed: {cublas}")
            report.row(kind="linear", rows=rows, config=label, failed=cublas)
            continue
        print(f"  linear {rows:>5} rows  {label}: {cublas * 1e3:8.3f} ms")
        report.row(kind="linear", rows=rows, config=label, seconds=cublas)
        base = Baseline(cublas, torch_product(), what=f"{label}'s")
        for config in LINEAR_CONFIGS:
            invariant = functools.partial(
                products_of, functools.partial(triton_ops.linear, config=config), pairs
            )
            base.record(
                report,
                {"kind": "linear", "rows": rows, "config": asdict(config)},
                f"  linear {rows:>5} rows  {config_name(config)}",
                invariant,
                attempt(invariant, reps),
                False,
                linear_figure,
            )
        del xs


def products_of(
    product: Callable[..., torch.Tensor], pairs: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """A layer's products (x, weight), one call each; the last one's result."""
    for x, w in pairs:
        out = product(x, w)
    return out


def attempt(fn: Callable[[], Any], reps: int, calls: int = 1) -> float | str:
    """timed(fn), or why it could not run (a config past the device's shared memory, say)."""
    try:
        return timed(fn, reps, calls)
    except Exception as exc:  # any failure to compile or launch: that config is left out
        if CUDA:
            torch.cuda.synchronize()
        return first_line(exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b" if CUDA else "tiny")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--reps", type=int, default=5 if CUDA else 1)
    parser.add_argument("--parts", default="prefill,decode,linear")
    parser.add_argument("--out", default=None, help="also append each figure as a JSON line here")
    args = parser.parse_args(argv)
    if not ta.available():
        print("no Triton here: nothing to time")
        return 1
    # the interpreter's bfloat16 products are wrong (triton_attention.py): float16 there
    dtype = getattr(torch, args.dtype or ("bfloat16" if CUDA else "float16"))
    device = "cuda" if CUDA else "cpu"
    shape = SHAPES[args.shape]
    where = torch.cuda.get_device_name() if CUDA else "CPU, Triton's interpreter"
    print(f"kernels: {args.shape} shape, {dtype}, {where}, torch {torch.__version__}, median of {args.reps}")
    report = Report(args.out)
    torch.manual_seed(0)
    parts = {"prefill": prefill, "decode": decode, "linear": linear}
    try:
        wanted = args.parts.split(",")
        for part in wanted:
            print(f"{part}:")
            parts[part](shape, dtype, device, args.reps, report)
            if CUDA:
                torch.cuda.empty_cache()
            # after each part, so that a run cut short by its time limit still says what it measured
            print("summary:" if part == wanted[-1] else f"summary so far ({part}):")
            for line in report.summary():
                print(f"  {line}")
    finally:
        report.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
