"""The packed decode step alone, eager against compiled, in one process: milliseconds per step for N
decoding jobs at a fixed context, and the compile's start-up time.

    python -m bench.step_time [--jobs 1 4 8 16] [--context 100] [--reps 30] [--dtype auto]

Both variants time `ModelStep.forward` (the step the runner calls, attention and KV writes included;
no scheduling, sampling or HTTP) on the thread that compiled and warmed them up, interleaved per job
count. Run it alone on the machine.
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
from proxy.settings import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE

from .support.waiting import wait_until


def prepare(args: argparse.Namespace, *, compile: bool) -> ModelStep:
    """A model of its own per variant (a compiled step needs the linear layers as loaded)."""
    lm = load_model(DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE, dtype=args.dtype, cache_dir=args.cache_dir)
    step = ModelStep.prepare(
        lm,
        slots=max(args.jobs),
        context=args.context + args.reps + 16,
        batch=True,
        batch_invariant=False,
        compile=compile,
    )
    started = time.perf_counter()
    step.warm_up(step.forward)
    wait_until(lambda: not step.compiling, "the compile", 900, interval=0.2)  # it runs on its own thread
    print(
        f"{'compiled' if compile else 'eager'}: warm-up {time.perf_counter() - started:.1f} s ({step.compile_status})"
    )
    return step


def step_ms(step: ModelStep, jobs: int, context: int, reps: int) -> float:
    """Median ms of a step of `jobs` decoding jobs, each with `context` tokens of KV."""
    kvs = [JobKV(step.pool, slot) for slot in (step.pool.acquire() for _ in range(jobs)) if slot is not None]
    for kv in kvs:
        kv.length = context
    times = []
    try:
        for _ in range(reps + 3):
            work = [Work(kv, [42], want_logits=True) for kv in kvs]
            started = time.perf_counter()
            step.forward(work)
            times.append(time.perf_counter() - started)
    finally:
        for kv in kvs:
            step.pool.release(kv.slot)
    return statistics.median(times[3:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--cache-dir", type=Path, default=Path("var/models"))
    args = parser.parse_args()
    use_cache_dir(args.cache_dir / "compiled")
    steps = {"eager": prepare(args, compile=False), "compiled": prepare(args, compile=True)}
    print(f"\n{steps['eager'].lm.dtype}, {args.context}-token contexts, medians of {args.reps}")
    print("| decoding jobs | eager ms | compiled ms | ratio |\n|---|---|---|---|")
    for jobs in args.jobs:
        eager, compiled = (step_ms(steps[k], jobs, args.context, args.reps) for k in ("eager", "compiled"))
        print(f"| {jobs} | {eager:.1f} | {compiled:.1f} | {compiled / eager:.2f} |")


if __name__ == "__main__":
    main()
