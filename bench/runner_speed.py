"""Local engine speed: prefill and decode tokens/s by prompt length and dtype, and first vs second start.

    python -m bench.runner_speed [--tokens 512 2048] [--dtypes float32 bfloat16] [--decode 32] [--reps 3]

The engine's own path is measured (job queue, preallocated cache, sampling), not a bare forward. The
first start converts the GGUF into a fresh cache folder; the second start loads that cache.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
import time
from pathlib import Path

from engine_api.sampling import SamplingParams
from engine_api.turn import Finished, FirstToken, GenerationRequest
from local_runner.engine import EmbeddedEngine
from local_runner.loader import LoadedModel, load_model
from proxy.local.config import engine_config
from proxy.settings import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE

TEXT = (
    "The history of computing is a story of layers: each generation of machines hides the details of the "
    "one below it, and each abstraction makes the next one possible. "
)


def prompt_ids(lm: LoadedModel, n: int) -> list[int]:
    """Exactly n tokens of ordinary prose (a real prompt, so the model keeps talking when decoding)."""
    ids = lm.tokenizer(TEXT * (n // 20 + 1))["input_ids"]
    return ids[:n]


async def one_job(engine: EmbeddedEngine, ids: list[int], decode: int) -> tuple[float, float, int]:
    """(prefill seconds, decode seconds, decoded tokens) for one greedy job."""
    job = engine.submit(
        GenerationRequest(
            DEFAULT_MODEL_NAME, ids, SamplingParams(max_tokens=decode, temperature=0), reuse=False
        )
    )
    start = time.monotonic()
    first_at = prefill = 0.0
    async for event in job.events():
        if isinstance(event, FirstToken):
            first_at, prefill = event.at, event.at - start
        elif isinstance(event, Finished):
            return prefill, time.monotonic() - first_at, event.completion_tokens
    raise RuntimeError("job failed")


def measure(lm: LoadedModel, tokens: list[int], decode: int, reps: int) -> list[dict]:
    config = engine_config(max_running=4, min_free_memory_bytes=0)  # one job at a time, no memory check
    engine = EmbeddedEngine({DEFAULT_MODEL_NAME: lm}, config=config).start()
    rows = []
    try:
        asyncio.run(one_job(engine, prompt_ids(lm, 64), 4))  # warm-up
        for n in tokens:
            ids = prompt_ids(lm, n)
            samples = [asyncio.run(one_job(engine, ids, decode)) for _ in range(reps)]
            prefill = statistics.median(s[0] for s in samples)
            decode_rate = statistics.median((s[2] - 1) / s[1] for s in samples if s[2] > 1 and s[1] > 0)
            rows.append(
                {
                    "dtype": str(lm.dtype).removeprefix("torch."),
                    "prompt_tokens": n,
                    "prefill_s": prefill,
                    "prefill_tok_s": n / prefill,
                    "decode_tok_s": decode_rate,
                }
            )
    finally:
        engine.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--decode", type=int, default=32, help="tokens decoded per job")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the cores available)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="attnstore-bench-models-") as cache:
        load = functools.partial(
            load_model,
            DEFAULT_MODEL_NAME,
            DEFAULT_MODEL_SOURCE,
            device="cpu",
            cache_dir=Path(cache),
            threads=args.threads,
        )
        first = load(dtype="float32").load_seconds  # converts the GGUF into the empty cache folder
        second = load(dtype="float32").load_seconds
        print(
            f"model load: first start {first:.1f} s (GGUF conversion), second start {second:.2f} s "
            f"({first / second:.0f}x faster)\n"
        )
        rows = []
        for dtype in args.dtypes:
            lm = load(dtype=dtype)
            rows += measure(lm, args.tokens, args.decode, args.reps)
    print("| dtype | prompt tokens | prefill s | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['prompt_tokens']} | {r['prefill_s']:.2f} | {r['prefill_tok_s']:.0f} "
            f"| {r['decode_tok_s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
