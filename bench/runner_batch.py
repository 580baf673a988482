"""Batched serving: aggregate decode tokens/s, TTFT and inter-token latency for N concurrent streams,
against the plain batched forward of the same model (the limit), measured in the same run.

    python -m bench.runner_batch [--streams 1 2 4 8 16] [--dtype auto] [--decode 64] [--prompt 256]

Also: the inter-token latency of 4 running streams while a new 2,000-token turn arrives (chunked
prefill shares the steps), the TTFT of that long prompt, and the TTFT of a reused turn (a hit) alone and
with 4 streams running. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from engine_api.sampling import SamplingParams
from engine_api.turn import Finished, FirstToken, GenerationRequest, TextDelta
from kvtier import KVStore, StoreConfig
from local_runner.engine import EmbeddedEngine
from local_runner.loader import LoadedModel, load_model, on_passing_thread
from proxy.local.config import engine_config
from proxy.settings import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE

MODEL = DEFAULT_MODEL_NAME
TEXT = (
    "The history of computing is a story of layers: each generation of machines hides the details of the "
    "one below it, and each abstraction makes the next one possible. "
)


def prompt_ids(lm: LoadedModel, n: int, salt: int = 0) -> list[int]:
    """n tokens of prose; `salt` makes prompts differ so no two jobs share a prefix."""
    ids = lm.tokenizer(f"Story {salt}. " + TEXT * (n // 20 + 2))["input_ids"]
    return ids[:n]


@dataclass
class Stream:
    submitted: float = 0.0
    first: float | None = None
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0
    reused: int = 0


async def run_stream(
    engine: EmbeddedEngine, ids: list[int], decode: int, *, reuse: bool = False, **kw
) -> Stream:
    s = Stream(submitted=time.monotonic())
    sampling = SamplingParams(max_tokens=decode, temperature=0)
    job = engine.submit(GenerationRequest(MODEL, ids, sampling, reuse=reuse, **kw))
    async for event in job.events():
        now = time.monotonic()
        if isinstance(event, FirstToken):
            s.first, s.reused = event.at, event.reused_tokens
        elif isinstance(event, TextDelta):
            s.token_times.append(now)
        elif isinstance(event, Finished):
            s.tokens = event.completion_tokens
    return s


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


@torch.inference_mode()
def plain_batched_limit(lm: LoadedModel, n: int, prompt: int, steps: int = 12) -> float:
    """Tokens/s of a plain padded batch of n rows decoding at a `prompt`-token cache (no engine)."""
    ids = torch.tensor([prompt_ids(lm, prompt, 0)] * n, device=lm.device)
    cache = DynamicCache(config=lm.model.config)
    out = lm.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = lm.model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t)
    return n / statistics.median(times[2:])


async def concurrency_row(engine: EmbeddedEngine, lm: LoadedModel, n: int, prompt: int, decode: int) -> dict:
    streams = await asyncio.gather(
        *(run_stream(engine, prompt_ids(lm, prompt, i + 100 * n), decode) for i in range(n))
    )
    rate = sum(
        (len(s.token_times) - 1) / (s.token_times[-1] - s.token_times[0])
        for s in streams
        if len(s.token_times) > 1
    )
    # Steady state: the window in which every stream is decoding (after the last first token, before
    # the first stream ends), so no prefill shares the steps.
    lo = max(s.token_times[0] for s in streams if s.token_times)
    hi = min(s.token_times[-1] for s in streams if s.token_times)
    in_window = sum(1 for s in streams for t in s.token_times if lo < t <= hi)
    steady = in_window / (hi - lo) if hi > lo else float("nan")
    itl = [g for s in streams for g in gaps(s.token_times)]
    ttft = [(s.first or 0) - s.submitted for s in streams]
    return {
        "streams": n,
        "tok_s": rate,
        "steady_tok_s": steady,
        "ttft_p50": pct(ttft, 0.5),
        "itl_p50": pct(itl, 0.5),
        "itl_p99": pct(itl, 0.99),
    }


async def long_prompt_arrives(engine: EmbeddedEngine, lm: LoadedModel, long_tokens: int) -> dict:
    """4 streams decoding; a new long turn arrives: their inter-token latency meanwhile, and its TTFT."""
    running = [asyncio.ensure_future(run_stream(engine, prompt_ids(lm, 200, 900 + i), 160)) for i in range(4)]
    await asyncio.sleep(1.0)
    long = await run_stream(engine, prompt_ids(lm, long_tokens, 999), 8)
    streams = await asyncio.gather(*running)
    lo, hi = long.submitted, long.first or long.submitted
    during = [
        b - a
        for s in streams
        for a, b in zip(s.token_times, s.token_times[1:], strict=False)
        if lo <= b <= hi
    ]
    return {
        "long_ttft": hi - lo,
        "itl_p50_during": pct(during, 0.5),
        "itl_p99_during": pct(during, 0.99),
    }


async def hit_ttft(engine: EmbeddedEngine, lm: LoadedModel, with_running: int) -> float:
    """TTFT of turn 2 of a conversation whose turn 1 (1,500 tokens + answer) is stored."""
    salt = 5000 + with_running
    first = prompt_ids(lm, 1500, salt)
    t1 = await run_stream(engine, first, 16, reuse=True, namespace="bench")
    del t1
    for store in engine.stores.values():
        store.flush()
    turn2 = first + prompt_ids(lm, 200, salt + 1)
    running = [
        asyncio.ensure_future(run_stream(engine, prompt_ids(lm, 200, 7000 + i), 96))
        for i in range(with_running)
    ]
    if running:
        await asyncio.sleep(1.0)
    s = await run_stream(engine, turn2, 4, reuse=True, namespace="bench")
    await asyncio.gather(*running)
    return (s.first or 0) - s.submitted


def run(args: argparse.Namespace) -> None:
    lm = load_model(MODEL, DEFAULT_MODEL_SOURCE, dtype=args.dtype, cache_dir=args.cache_dir)
    print(
        f"model {MODEL} on {lm.device} as {str(lm.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads"
    )
    with tempfile.TemporaryDirectory() as tmp:
        store = KVStore(
            StoreConfig(
                l0_capacity_bytes=1 << 30,
                l1_capacity_bytes=1 << 30,
                l2_capacity_bytes=4 << 30,
                l2_path=Path(tmp),
                chunk_tokens=256,
                device=lm.device,
            ),
            lm.layout,
            lm.fingerprint,
        )
        engine = EmbeddedEngine(
            {MODEL: lm},
            {MODEL: store},
            config=engine_config(
                max_running=max(*args.streams, 8),  # room for the long prompt and the hit beside 4 streams
                max_queue=64,
                max_batch_tokens=args.max_batch_tokens,
                min_free_memory_bytes=0,
            ),
        ).start()
        try:
            asyncio.run(run_stream(engine, prompt_ids(lm, 64), 4))  # warm-up
            print(f"\nprompt {args.prompt} tokens, {args.decode} greedy tokens per stream")
            print(
                "| streams | aggregate decode tok/s | all decoding tok/s | plain batched limit tok/s | ratio | TTFT p50 s | ITL p50 ms | ITL p99 ms |"
            )
            print("|---|---|---|---|---|---|---|---|")
            for n in args.streams:
                if args.per_job:  # a engine per row: its thread's OpenMP team ends with it (loader.py)
                    per_job = EmbeddedEngine(
                        {MODEL: lm},
                        config=engine_config(
                            max_running=max(args.streams), max_queue=64, min_free_memory_bytes=0, batch=False
                        ),
                    ).start()
                    try:
                        row = asyncio.run(concurrency_row(per_job, lm, n, args.prompt, args.decode))
                    finally:
                        per_job.close()
                    print(
                        f"| {n} one forward per job | {row['tok_s']:.1f} | {row['steady_tok_s']:.1f} | | | "
                        f"{row['ttft_p50']:.2f} | {row['itl_p50'] * 1000:.0f} | {row['itl_p99'] * 1000:.0f} |"
                    )
                row = asyncio.run(concurrency_row(engine, lm, n, args.prompt, args.decode))
                limit = on_passing_thread(plain_batched_limit, lm, n, args.prompt)  # see its docstring
                print(
                    f"| {n} | {row['tok_s']:.1f} | {row['steady_tok_s']:.1f} | {limit:.1f} | {row['tok_s'] / limit:.2f} | "
                    f"{row['ttft_p50']:.2f} | {row['itl_p50'] * 1000:.0f} | {row['itl_p99'] * 1000:.0f} |"
                )
            if args.long:
                alone = asyncio.run(run_stream(engine, prompt_ids(lm, args.long, 4242), 4))
                r = asyncio.run(long_prompt_arrives(engine, lm, args.long))
                print(
                    f"\nlong prompt ({args.long} tokens, no reuse): TTFT alone {(alone.first or 0) - alone.submitted:.2f} s, "
                    f"with 4 streams running {r['long_ttft']:.2f} s; the 4 streams' ITL meanwhile "
                    f"p50 {r['itl_p50_during'] * 1000:.0f} ms, p99 {r['itl_p99_during'] * 1000:.0f} ms"
                )
                h0 = asyncio.run(hit_ttft(engine, lm, 0))
                h4 = asyncio.run(hit_ttft(engine, lm, 4))
                print(
                    f"hit (1,500 reused + 200 new tokens): TTFT alone {h0:.2f} s, with 4 streams running {h4:.2f} s"
                )
        finally:
            engine.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.runner_batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--long", type=int, default=2000, help="the long prompt's tokens (0: skip that part)")
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument(
        "--per-job", action="store_true", help="also run each N with one forward per job (no batching)"
    )
    p.add_argument("--cache-dir", default="./var/models")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
