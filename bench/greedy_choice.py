"""The greedy choice of a step's rows: torch.max's indices (sampling.first_max, the engine's) against
torch.argmax (what it replaced), alone and as the engine's decode throughput, in one run.

    python -m bench.greedy_choice [--dtype bfloat16] [--streams 1 16 32] [--decode 64] [--rounds 3]

Prints milliseconds per call at the default model's vocabulary for 1 to 32 rows, then the aggregate
decode tokens/s of N greedy streams on the embedded engine with each choice, rounds alternating between
the two (the engine's own path: scheduling, forward, sampling, text). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine_api.sampling import SamplingParams
from engine_api.turn import Finished, GenerationRequest
from local_runner import sampling
from local_runner.engine import EmbeddedEngine
from local_runner.loader import load_model
from proxy.local.config import engine_config
from proxy.settings import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The choice before first_max: the same indices (the first of ties), argmax's CPU kernel."""
    return logits.argmax(dim=-1)


CHOICES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "argmax": argmax_rows,
    "first_max": sampling.first_max,
}


def per_call(dtype: torch.dtype, vocab: int, rows_list: list[int], reps: int = 200) -> None:
    for rows in rows_list:
        x = torch.randn(rows, vocab).to(dtype)
        ms = {}
        for name, choose in CHOICES.items():
            choose(x).tolist()
            started = time.perf_counter()
            for _ in range(reps):
                choose(x).tolist()
            ms[name] = (time.perf_counter() - started) / reps * 1e3
        assert torch.equal(argmax_rows(x), sampling.first_max(x))
        print(
            f"  {rows:>2} rows x {vocab}: argmax {ms['argmax']:.3f} ms, first_max {ms['first_max']:.3f} ms"
            f" (x{ms['first_max'] / ms['argmax']:.2f})"
        )


async def streams(engine: EmbeddedEngine, prompt: list[int], n: int, decode: int) -> float:
    """Aggregate decode tokens/s of n greedy streams started together."""

    async def one() -> int:
        job = engine.submit(
            GenerationRequest(
                DEFAULT_MODEL_NAME,
                prompt,
                SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True),
                reuse=False,
            )
        )
        async for event in job.events():
            if isinstance(event, Finished):
                return event.completion_tokens
        raise RuntimeError("the job failed")

    started = time.perf_counter()
    tokens = await asyncio.gather(*(one() for _ in range(n)))
    return sum(tokens) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache-dir", type=Path, default=Path("var/models"))
    args = ap.parse_args(argv)
    lm = load_model(DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE, dtype=args.dtype, cache_dir=args.cache_dir)
    vocab = lm.model.config.vocab_size
    print(f"one call, {lm.dtype}, {torch.get_num_threads()} threads:")
    per_call(lm.dtype, vocab, [1, 8, 16, 32])
    most = max(args.streams)
    engine = EmbeddedEngine({DEFAULT_MODEL_NAME: lm}, config=engine_config(max_running=most)).start()
    prompt = lm.tokenizer("The history of computing is a story of layers.")["input_ids"]
    rates: dict[tuple[str, int], list[float]] = {}
    try:
        asyncio.run(streams(engine, prompt, 2, 8))  # warm-up
        for _ in range(args.rounds):
            for name, choose in CHOICES.items():
                sampling.first_max = choose  # type: ignore[assignment]  # the baseline's choice, swapped in
                for n in args.streams:
                    rates.setdefault((name, n), []).append(
                        asyncio.run(streams(engine, prompt, n, args.decode))
                    )
    finally:
        sampling.first_max = CHOICES["first_max"]  # type: ignore[assignment]
        engine.close()
    print(f"decode tokens/s, {args.decode} tokens a stream, median of {args.rounds} alternating rounds:")
    for n in args.streams:
        before, after = (statistics.median(rates[(name, n)]) for name in CHOICES)
        print(f"  {n:>2} streams: argmax {before:7.1f}, first_max {after:7.1f} (x{after / before:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
