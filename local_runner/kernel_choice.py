"""The CUDA step's kernel configs for one model, chosen by timing them on this device at the model's
shape before the first step, and kept per kind of device: an H100, an H200 or an L4 each gets its own.

Why measured, and why once: a config (tiles, warps, pipeline stages) is fast or slow by the device's
SMs, shared memory and L2 and by the model's heads, which no rule written ahead of time knows. And a
row's sums follow its config (triton_attention.AttentionConfig), so one config serves every launch of a
model for the life of the process; kept in a file (the cache folder's `kernels/`, by device, torch,
Triton and CUDA: device_key) and read at every later start, it also makes a restart compute as the
first start did, at no cost.

- **Attention**: the candidates for the model's dtype, timed at three steps: a prompt step from key 0,
  a decode batch at DECODE_KEYS keys, one job decoding at LONG_KEYS keys (its pool copied past the L2,
  as each layer's keys are read once a step). The default stays unless one that ran and agreed with it
  at every step is faster by MARGIN (the geometric mean of its ratios to the default, the prompt step
  weighing as much as the two decode steps together: time to a first token and time per token alike).
- **The invariant product** (`batch_invariant`'s triton_ops.linear), where batch invariance is on or
  "auto": the candidates timed at the layer's four products (the model's own weights) at 1 row, a
  decode batch's rows and a prompt step's, against cuBLAS; the least geometric mean wins. "auto" turns
  batch invariance on where that config's worst ratio is within INVARIANT_COST_BOUND of cuBLAS (issue
  36: an exact step at most 15% slower than the fastest), and says so either way.

Each timing replays a CUDA graph of the call (no Python launch cost in it, as the engine replays its
decode steps). A candidate that fails to compile or launch, or whose output differs from the
reference's, is left out; a measurement that fails as a whole keeps the defaults, says why, and is not
kept. On a CPU (the tests) the same code runs under Triton's interpreter.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from . import triton_attention as ta
from . import triton_ops
from .compiled import first_line
from .kept import read_kept, write_kept
from .loader import on_model_device

log = logging.getLogger("attnstore.runner")

# "auto" batch invariance on CUDA: where the invariant products' worst time is at most this multiple
# of cuBLAS's (issue 36: the exact step no more than 15% below the fastest one).
INVARIANT_COST_BOUND = 1.15
# Another attention config replaces the default only at this fraction of its time or less: a tie within
# the timing's noise keeps the config the tests compile and check.
MARGIN = 0.98
# Candidates not started within this many seconds of the measurement's start are not timed: the
# engine's start waits for the measurement (compiling a config costs seconds on a device).
BUDGET_S = 120.0
PROMPT_ROWS = 4096  # a prompt step's tokens timed, at most (the step's budget if smaller)
DECODE_JOBS = 32  # a decode batch's jobs timed, at most (max_running if smaller)
DECODE_KEYS = 2048
LONG_KEYS = 8192
L2_FLUSH_BYTES = 256 << 20  # a long job's pool is copied until the copies pass a device's L2 (50-60 MB)
# ...but never more copies than this: a tiny model's pool (a test's) would need thousands of 12 KB copies,
# each its own kernel launch, where a few dozen already run past L2's reuse.
L2_FLUSH_COPIES = 64
REPS = 5

# The alternatives to the engine's configs (triton_attention.config_for, triton_ops.ENGINE_LINEAR).
# 16-bit: tensor-core tiles; float32: IEEE FMAs with no tensor cores, whose operands spill past 16-key
# blocks (bench/gpu/triton_aot.py), so narrower tiles only.
_ATTENTION_16BIT = (
    ta.AttentionConfig(num_stages=3),
    ta.AttentionConfig(num_warps=8),
    ta.AttentionConfig(block_m=128, num_warps=8),
    ta.AttentionConfig(block_n=32),
    ta.AttentionConfig(block_m=128, block_n=32, num_warps=8, num_stages=3),
    ta.AttentionConfig(block_n=16, num_warps=8),
)
_ATTENTION_FLOAT32 = (  # each spill-free for sm_90 (python -m bench.gpu.triton_aot --dtype float32)
    ta.AttentionConfig(block_n=16, num_warps=8, num_stages=3),
    ta.AttentionConfig(block_m=32, block_n=16, num_warps=8),
    ta.AttentionConfig(block_m=32, block_n=16, num_warps=4, num_stages=3),
)
LINEAR_CANDIDATES = (
    triton_ops.ENGINE_LINEAR,
    triton_ops.LinearConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
    triton_ops.LinearConfig(block_n=128, num_stages=3),
    triton_ops.LinearConfig(block_k=128, num_stages=3),
    # narrower tiles: more programs for a decode step's few rows (N / 32 of them), less reuse at many
    triton_ops.LinearConfig(block_n=32, block_k=128, num_stages=4),
)

Timer = Callable[[Callable[[], Any], int], float]
"""timer(fn, calls): seconds of one of the `calls` calls `fn` makes (see `timed`)."""

Config = TypeVar("Config", ta.AttentionConfig, triton_ops.LinearConfig)


def attention_candidates(dtype: torch.dtype) -> tuple[ta.AttentionConfig, ...]:
    """The engine's config for `dtype` first, then the alternatives."""
    default = ta.config_for(dtype)
    others = _ATTENTION_FLOAT32 if dtype == torch.float32 else _ATTENTION_16BIT
    return (default, *(c for c in others if c != default))


def timed(fn: Callable[[], Any], calls: int = 1, reps: int = REPS) -> float:
    """Seconds of one of the `calls` calls `fn` makes, the median of `reps` after one untimed run
    (Triton compiles at the first). On CUDA `fn` is captured in a CUDA graph and replayed, as the
    engine replays its decode steps: a launch from Python costs tens of microseconds, which a decode
    step's kernels would otherwise be timed by (eagerly where the capture fails). The capture errs only
    on this thread's unsafe calls: the store's threads may page-lock host memory meanwhile."""
    cuda = torch.cuda.is_available()
    fn()
    run = fn
    if cuda:
        torch.cuda.synchronize()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                fn()
            run = graph.replay
        except Exception:  # a capture this torch or kernel does not allow: timed eagerly
            torch.cuda.synchronize()
        run()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / calls


@dataclass(frozen=True)
class ModelShape:
    """What the timings depend on: the model's attention heads, its KV pages, dtype, and the step sizes
    it serves."""

    heads: int
    kv_heads: int
    head_dim: int
    page_tokens: int
    dtype: torch.dtype
    prompt_rows: int  # a prompt step's tokens timed
    decode_jobs: int  # a decode batch's jobs timed
    context: int  # the most keys a job holds

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.heads}x{self.kv_heads}x{self.head_dim} page {self.page_tokens} {dtype} prompt "
            f"{self.prompt_rows} decode {self.decode_jobs} context {self.context}"
        )


@dataclass(frozen=True)
class KernelChoice:
    """The configs a model's CUDA step launches with, and how they were chosen."""

    attention: ta.AttentionConfig
    attention_how: str  # "measured in N s: ...", "kept (path)", "default (why)"
    linear: triton_ops.LinearConfig | None  # the invariant product's; None where it was not asked for
    linear_how: str
    invariant_cost: float | None  # that config's worst time against cuBLAS's, where measured

    def describe(self) -> dict[str, str]:
        """For /healthz."""
        out = {"attention": f"{config_name(self.attention)} ({self.attention_how})"}
        if self.linear is not None:
            out["invariant_product"] = f"{config_name(self.linear)} ({self.linear_how})"
        return out


def config_name(config: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in asdict(config).items())


def device_key(device: torch.device) -> str:
    """What the timings depend on beyond the model: the device's name and compute capability, and the
    torch, Triton and CUDA that compile and run the kernels."""
    import triton

    versions = f"{torch.__version__}|{triton.__version__}|{torch.version.cuda}"
    digest = hashlib.sha256(versions.encode()).hexdigest()[:10]
    if device.type != "cuda":
        return f"{device.type}-triton-interpreter-{digest}"
    name = "".join(c if c.isalnum() else "_" for c in torch.cuda.get_device_name(device)).strip("_")
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda-{name}-sm{major}{minor}-{digest}"


def _kept_path(
    folder: Path, what: str, shape: ModelShape, candidates: Sequence[Any], products: str = ""
) -> Path:
    """The file of one measurement: its name says what and for which dtype and heads (and `products`, the
    invariant product's weight shapes: two models of the same heads keep a file each, write_kept
    replacing only a file of the same name); its digest covers the shape, the candidates and the
    kernels' and this module's sources (a changed kernel is measured again)."""
    digest = hashlib.sha256(f"{shape.describe()}|{[asdict(c) for c in candidates]}".encode())
    for module in (ta, triton_ops):
        digest.update(Path(module.__file__ or "").read_bytes())
    digest.update(Path(__file__).read_bytes())
    dtype = str(shape.dtype).removeprefix("torch.")
    tag = f"-{products}" if products else ""
    return (
        folder
        / f"{what}-{dtype}-{shape.heads}x{shape.kv_heads}x{shape.head_dim}{tag}-{digest.hexdigest()[:10]}.json"
    )


def _products_tag(weights: Sequence[torch.Tensor]) -> str:
    """The layer's products' shapes, short: what the invariant product's timings depend on beyond the
    heads (the hidden and intermediate sizes)."""
    shapes = ",".join("x".join(map(str, w.shape)) for w in weights)
    return hashlib.sha256(shapes.encode()).hexdigest()[:8]


def choose(
    shape: ModelShape,
    device: torch.device,
    *,
    invariant: bool | None,
    weights: Sequence[torch.Tensor],
    folder: Path | None,
    timer: Timer = timed,
    attention: Sequence[ta.AttentionConfig] | None = None,
    linear: Sequence[triton_ops.LinearConfig] | None = None,
) -> tuple[KernelChoice, bool]:
    """The configs for a model of `shape` on `device` (kept ones where `folder` holds them, else
    measured and kept there), and whether its step is batch-invariant: `invariant`, or for None
    ("auto") whether the invariant products measured within INVARIANT_COST_BOUND of cuBLAS.
    `weights`: the layer's products' weights [N, K] (the model's own), for the invariant product."""
    candidates = tuple(attention or attention_candidates(shape.dtype))
    started = time.perf_counter()  # BUDGET_S bounds both measurements together: the start waits for them
    with on_model_device(device):  # the timings' graphs, events and launches, whichever is current
        att, att_how = _chosen_attention(shape, device, folder, timer, candidates, started)
        if invariant is False:
            return KernelChoice(att, att_how, None, "", None), False
        linear = tuple(linear or LINEAR_CANDIDATES)
        lin, lin_how, cost = _chosen_linear(shape, device, weights, folder, timer, linear, started)
    if invariant is None:
        invariant = cost is not None and cost <= INVARIANT_COST_BOUND
        verdict = "on" if invariant else "off"
        measured = f"worst x{cost:.2f} of cuBLAS" if cost is not None else "not measured"
        lin_how = f"{lin_how}; batch_invariant auto: {verdict} ({measured}, bound x{INVARIANT_COST_BOUND})"
    return KernelChoice(att, att_how, lin, lin_how, cost), invariant


def _chosen_attention(
    shape: ModelShape,
    device: torch.device,
    folder: Path | None,
    timer: Timer,
    candidates: tuple[ta.AttentionConfig, ...],
    started: float,
) -> tuple[ta.AttentionConfig, str]:
    default = candidates[0]
    path = _kept_path(folder, "attention", shape, candidates) if folder is not None else None
    kept = read_kept(path, functools.partial(_valid_kept, ta.AttentionConfig)) if path else None
    if kept is not None:
        return ta.AttentionConfig(**kept["config"]), f"kept: {kept['how']}"
    began = time.perf_counter()
    try:  # the points' buffers are no name's here: _free gives them back
        best, how = _fastest(
            _attention_points(shape, device),
            candidates,
            timer,
            reference=None,
            started=started,
            margin=MARGIN,
        )
    except Exception as exc:  # any failure of the measurement: the defaults serve, said once
        reason = first_line(exc)
        log.warning("kernel configs: the attention's measurement failed (%s): the default serves", reason)
        return default, f"default (measurement failed: {reason})"
    finally:
        _free(device)
    text = f"measured in {time.perf_counter() - began:.1f} s: {how.text}"
    if path is not None:
        write_kept(path, {"config": asdict(best), "how": text})
    return best, text


def _chosen_linear(
    shape: ModelShape,
    device: torch.device,
    weights: Sequence[torch.Tensor],
    folder: Path | None,
    timer: Timer,
    candidates: tuple[triton_ops.LinearConfig, ...],
    started: float,
) -> tuple[triton_ops.LinearConfig, str, float | None]:
    path = (
        _kept_path(folder, "linear", shape, candidates, _products_tag(weights))
        if folder is not None
        else None
    )
    kept = read_kept(path, functools.partial(_valid_kept, triton_ops.LinearConfig)) if path else None
    if kept is not None and isinstance(kept.get("cost"), float):
        return triton_ops.LinearConfig(**kept["config"]), f"kept: {kept['how']}", kept["cost"]
    began = time.perf_counter()
    try:
        best, how = _measure_linear(shape, device, weights, timer, candidates, started)
    except Exception as exc:
        log.warning("kernel configs: the invariant product's measurement failed (%s)", first_line(exc))
        return candidates[0], f"default (measurement failed: {first_line(exc)})", None
    finally:
        _free(device)
    text = f"measured in {time.perf_counter() - began:.1f} s, against cuBLAS: {how.text}"
    if path is not None:
        write_kept(path, {"config": asdict(best), "how": text, "cost": how.worst})
    return best, text, how.worst


def _measure_linear(
    shape: ModelShape,
    device: torch.device,
    weights: Sequence[torch.Tensor],
    timer: Timer,
    candidates: tuple[triton_ops.LinearConfig, ...],
    started: float,
) -> tuple[triton_ops.LinearConfig, _Outcome]:
    """The invariant product's measurement; its buffers (inputs, cuBLAS's outputs) end with this call,
    before _free gives the memory back."""
    points = _linear_points(shape, device, weights)
    return _fastest(points, candidates, timer, reference=_Reference(points, timer), started=started)


def _valid_kept(kind: type, data: Any) -> bool:
    """A kept choice: its config's fields make a config of `kind` (which checks its values), its `how`
    a line."""
    if not (
        isinstance(data, dict) and isinstance(data.get("config"), dict) and isinstance(data.get("how"), str)
    ):
        return False
    try:
        kind(**data["config"])
    except (TypeError, ValueError):
        return False
    return all(isinstance(v, int) for v in data["config"].values())


@dataclass
class _Point:
    """One timed step: `run(config)` makes the call for a config, `calls` the launches one run makes,
    `weight` its share of the score (prompt steps and decode steps count alike)."""

    name: str
    run: Callable[[Any], Callable[[], Any]]
    calls: int = 1
    weight: float = 1.0


@dataclass(frozen=True)
class _Outcome:
    ratio: float  # the geometric mean of the winner's ratios to the reference's
    worst: float  # the largest of them
    text: str


class _Reference:
    """cuBLAS's time and output at each point: what the invariant product's candidates are measured
    against (the attention's reference is its default config, timed among the candidates)."""

    def __init__(self, points: list[_Point], timer: Timer) -> None:
        self.seconds: list[float] = []
        self.out: list[Any] = []
        for point in points:
            run = point.run(None)
            self.seconds.append(timer(run, point.calls))
            self.out.append(run())


def _fastest(
    points: list[_Point],
    candidates: Sequence[Config],
    timer: Timer,
    *,
    reference: _Reference | None,
    started: float,
    margin: float | None = None,
) -> tuple[Config, _Outcome]:
    """The candidate of least geometric-mean time against the reference (cuBLAS, or else the first
    candidate) among those that ran and agreed with it at every point; with `margin`, the first
    candidate unless another takes at most `margin` of its time. Raises when none ran and agreed."""
    ratios: dict[int, list[float]] = {}
    left_out: list[str] = []
    base_seconds = reference.seconds if reference is not None else None
    base_out = reference.out if reference is not None else None
    for index, config in enumerate(candidates):
        if index and time.perf_counter() - started > BUDGET_S:  # the first is always timed
            left_out.append(f"{len(candidates) - index} not timed (past {BUDGET_S:.0f} s)")
            break
        try:
            runs = [point.run(config) for point in points]
            seconds = [timer(run, point.calls) for run, point in zip(runs, points, strict=True)]
            outs = [run() for run in runs]
        except Exception as exc:  # a config this device cannot take (shared memory, registers)
            left_out.append(f"{config_name(config)}: {first_line(exc)}")
            continue
        if base_seconds is None or base_out is None:  # the first that ran is the reference
            base_seconds, base_out = seconds, outs
        bad = next((p.name for p, o, b in zip(points, outs, base_out, strict=True) if not agrees(o, b)), None)
        if bad is not None:
            left_out.append(f"{config_name(config)}: differs at {bad}")
            continue
        ratios[index] = [s / b for s, b in zip(seconds, base_seconds, strict=True)]
    if not ratios:
        raise RuntimeError("no candidate ran and agreed: " + "; ".join(left_out))
    weights = [p.weight for p in points]
    score = {i: _geomean(r, weights) for i, r in ratios.items()}
    best = min(score, key=score.__getitem__)
    kept_first = margin is not None and best != 0 and 0 in ratios and score[best] > margin
    text = f"x{score[best]:.2f} (worst x{max(ratios[best]):.2f})"
    if kept_first:
        text = f"the fastest, {config_name(candidates[best])}, {text}: within x{margin} of the default, kept"
        best = 0
    text += f" over {', '.join(p.name for p in points)}; {len(ratios)} of {len(candidates)} candidates ran"
    if left_out:
        text += " (left out: " + "; ".join(left_out) + ")"
    return candidates[best], _Outcome(score[best], max(ratios[best]), text)


def _geomean(values: list[float], weights: list[float]) -> float:
    """The weighted geometric mean."""
    return math.exp(sum(w * math.log(v) for v, w in zip(values, weights, strict=True)) / sum(weights))


Output = torch.Tensor | tuple[torch.Tensor, ...]


def agrees(out: Output, reference: Output) -> bool:
    """Whether `out` is the reference within its dtype's rounding (the relative error of each whole
    tensor): a config that is fast but wrong is no choice."""
    if isinstance(out, tuple) and isinstance(reference, tuple):
        return len(out) == len(reference) and all(map(agrees, out, reference))
    assert isinstance(out, torch.Tensor) and isinstance(reference, torch.Tensor)
    a, b = out.float(), reference.float()
    if not torch.isfinite(a).all():
        return False
    tolerance = 1e-4 if out.dtype == torch.float32 else 2e-2
    return float((a - b).norm()) <= tolerance * max(float(b.norm()), 1e-6)


def _attention_points(shape: ModelShape, device: torch.device) -> list[_Point]:
    """A prompt step from key 0, a decode batch, and one long decoding job over copies of its pool."""
    scale = shape.head_dim**-0.5
    points = []
    prompt = min(shape.prompt_rows, shape.context)
    k, v, table = _pool(shape, device, [prompt])
    q = _random((prompt, shape.heads, shape.head_dim), shape.dtype, device)
    points.append(
        _Point(
            f"a {prompt}-token prompt step",
            functools.partial(
                _attend, shape, q, [(k, v)], table, [0] * prompt, list(range(1, prompt + 1)), scale
            ),
        )
    )
    jobs, keys = shape.decode_jobs, min(DECODE_KEYS, shape.context)
    k, v, tables = _pool(shape, device, [keys] * jobs)
    q = _random((jobs, shape.heads, shape.head_dim), shape.dtype, device)
    points.append(
        _Point(
            f"{jobs} jobs decoding at {keys} keys",
            functools.partial(_attend, shape, q, [(k, v)], tables, list(range(jobs)), [keys] * jobs, scale),
            weight=0.5,
        )
    )
    keys = min(LONG_KEYS, shape.context)
    layers = []
    while True:
        k, v, table = _pool(shape, device, [keys])
        layers.append((k, v))
        copied = len(layers) * 2 * k.numel() * k.element_size()
        if device.type != "cuda" or copied >= L2_FLUSH_BYTES or len(layers) >= L2_FLUSH_COPIES:
            break
    q = _random((1, shape.heads, shape.head_dim), shape.dtype, device)
    points.append(
        _Point(
            f"1 job decoding at {keys} keys",
            functools.partial(_attend, shape, q, layers, table, [0], [keys], scale),
            calls=len(layers),
            weight=0.5,
        )
    )
    return points


def _attend(
    shape: ModelShape,
    q: torch.Tensor,
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    tables: torch.Tensor,
    jobs: list[int],
    lengths: list[int],
    scale: float,
    config: ta.AttentionConfig,
) -> Callable[[], torch.Tensor]:
    """The launch of one step for `config` over each layer's pool in turn (the plan made once)."""
    meta = ta.plan(tables, jobs, lengths, shape.heads, shape.kv_heads, config)

    def run() -> torch.Tensor:
        for k, v in layers:
            out = ta.attend(q, k, v, meta, scale)
        return out

    return run


def _pool(
    shape: ModelShape, device: torch.device, keys: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer of a page pool holding each job's `keys`, laid out as kv_pages.PagePool's layer (K and V
    of a page side by side), its pages in a shuffled order (as a pool that has served a while hands them
    out): k, v [pages, kv_heads, page_tokens, dim] and the jobs' page tables [jobs, width] int32."""
    per_job = -(-max(keys) // shape.page_tokens)
    pages = per_job * len(keys)
    buf = _random((pages, 2, shape.kv_heads, shape.page_tokens, shape.head_dim), shape.dtype, device)
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(pages)).to(torch.int32)
    return buf[:, 0], buf[:, 1], order.reshape(len(keys), per_job).to(device)


def _random(size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(sum(size))
    return torch.randn(size, generator=generator, device=device).to(dtype)


def _linear_points(shape: ModelShape, device: torch.device, weights: Sequence[torch.Tensor]) -> list[_Point]:
    """The layer's products at 1 row, a decode batch's rows and a prompt step's."""
    points = []
    decode = sorted({1, shape.decode_jobs} - {shape.prompt_rows})
    for rows in [*decode, shape.prompt_rows]:  # the decode steps weigh as much as the prompt step
        xs = [_random((rows, int(w.shape[1])), shape.dtype, device) for w in weights]
        run = functools.partial(_products, list(zip(xs, weights, strict=True)))
        weight = 1.0 / len(decode) if rows != shape.prompt_rows else 1.0
        points.append(_Point(f"{rows} rows", run, weight=weight))
    return points


def _products(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], config: triton_ops.LinearConfig | None
) -> Callable[[], tuple[torch.Tensor, ...]]:
    """The layer's products, one call each, by the invariant product in `config` (None: cuBLAS); every
    output, so that each product is compared."""

    def run() -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(x, w) if config is None else triton_ops.linear(x, w, config) for x, w in pairs)

    return run


def _free(device: torch.device) -> None:
    """The measurement's buffers back to the driver before the KV pool is sized from its free memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
