"""The packed step alone, two variants in one process: milliseconds per decode step for N decoding jobs
at fixed contexts, the prefill of a long prompt, and each variant's start-up time.

    python -m bench.step_time [--jobs 1 4 8 16] [--context 100 1000] [--reps 30] [--dtype auto]
                              [--variants exact compiled] [--prefill 2000]

Variants: `exact` (the default engine: batch_invariant, eager), `compiled` (batch_invariant false,
torch.compile: the rounding-dependent path), `eager` (batch_invariant false, eager), `exact-unfused`
(the exact step on torch's elementwise operations, not exact_elementwise.cpp's). Each times
`ModelStep.forward` (the step the runner calls, attention and KV writes included; no scheduling,
sampling or HTTP) on the thread that warmed it up, the variants alternating step by step. Run it alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from local_runner.compiled import use_cache_dir
from local_runner.job_kv import JobKV
from local_runner.loader import load_model
from local_runner.model_step import ModelStep
from local_runner.step import Work
from proxy.local.config import engine_config
from proxy.settings import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE

from .support.waiting import wait_until

VARIANTS = {
    "exact": (False, True),
    "exact-unfused": (False, True),
    "compiled": (True, False),
    "eager": (False, False),
}


def prepare(args: argparse.Namespace, variant: str) -> ModelStep:
    """A model of its own per variant (a compiled step needs the linear layers as loaded)."""
    compile, invariant = VARIANTS[variant]
    lm = load_model(DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE, dtype=args.dtype, cache_dir=args.cache_dir)
    step = ModelStep.prepare(
        lm,
        slots=max(args.jobs),
        context=max(max(args.context) + args.reps + 16, args.prefill + 16),
        batch=True,
        batch_invariant=invariant,
        compile=compile,
        max_rows=engine_config().max_step_rows,
    )
    if variant == "exact-unfused" and step.stack is not None:
        step.stack.fused = False
    started = time.perf_counter()
    step.warm_up(step.forward)
    wait_until(lambda: not step.compiling, "the compile", 900, interval=0.2)  # it runs on its own thread
    print(f"{variant}: warm-up {time.perf_counter() - started:.1f} s ({step.compile_status})")
    return step


def prefill_s(step: ModelStep, tokens: int, chunk: int = 512) -> float:
    """Seconds to prefill a fresh `tokens`-token prompt in chunks of `chunk` (the runner's default)."""
    kv = JobKV(step.pool)
    kv.ensure(tokens)
    try:
        started = time.perf_counter()
        for first in range(0, tokens, chunk):
            n = min(chunk, tokens - first)
            step.forward(
                [Work(kv, [42 + (first + i) % 1000 for i in range(n)], want_logits=first + n == tokens)]
            )
        return time.perf_counter() - started
    finally:
        kv.release()


def step_ms(steps: dict[str, ModelStep], jobs: int, context: int, reps: int) -> dict[str, float]:
    """Median ms of a step of `jobs` decoding jobs, each with `context` tokens of KV, per variant; the
    variants alternate step by step (the first one alternating too), so drifts of the machine hit both."""
    kvs = {}
    for name, step in steps.items():
        kvs[name] = [JobKV(step.pool) for _ in range(jobs)]
        for kv in kvs[name]:
            kv.ensure(context + reps + 4)
            kv.length = context
    times: dict[str, list[float]] = {name: [] for name in steps}
    try:
        for rep in range(reps + 3):
            for name in sorted(steps, reverse=rep % 2 == 1):
                work = [Work(kv, [42], want_logits=True) for kv in kvs[name]]
                started = time.perf_counter()
                steps[name].forward(work)
                times[name].append(time.perf_counter() - started)
    finally:
        for name in steps:
            for kv in kvs[name]:
                kv.release()
    return {name: statistics.median(t[3:]) * 1000 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--context", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--prefill", type=int, default=2000, help="a prompt's tokens to time (0: none)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--variants", nargs=2, default=["exact", "compiled"], choices=sorted(VARIANTS))
    parser.add_argument("--cache-dir", type=Path, default=Path("var/models"))
    args = parser.parse_args()
    use_cache_dir(args.cache_dir / "compiled")
    a, b = args.variants
    steps = {v: prepare(args, v) for v in (a, b)}
    for context in args.context:
        print(f"\n{steps[a].lm.dtype}, {context}-token contexts, medians of {args.reps}, interleaved")
        print(f"| decoding jobs | {a} ms | {b} ms | {a} / {b} |\n|---|---|---|---|")
        for jobs in args.jobs:
            ms = step_ms(steps, jobs, context, args.reps)
            print(f"| {jobs} | {ms[a]:.1f} | {ms[b]:.1f} | {ms[a] / ms[b]:.2f} |", flush=True)
    if args.prefill:
        times: dict[str, list[float]] = {a: [], b: []}
        for _ in range(3):
            for v in (a, b):
                times[v].append(prefill_s(steps[v], args.prefill))
        x, y = (statistics.median(times[v]) for v in (a, b))
        print(f"| prefill {args.prefill} tokens (s) | {x:.2f} | {y:.2f} | {x / y:.2f} |")


if __name__ == "__main__":
    main()
