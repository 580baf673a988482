"""Two store switches measured on the engine (no HTTP): `preload.overlap_with_compute` and
`scheduler_aware.placement_hint`, each variant interleaved with the other in one run.

    python -m bench.tier_policies [--history 2000] [--reps 5]

Overlap: turn 2 of a conversation whose turn 1 (`--history` tokens + answer) is on disk only (no memory
tiers, page cache dropped after writing, a new conversation per repetition so every read is cold); TTFT
with the restore overlapping the model's compute layer by layer, against restoring everything first.
Placement: turn 2 right after turn 1 with room in L0 and L1; `ttft_priority` keeps turn 1's KV in L0,
`throughput` in L1 (on a CPU both are host memory; on CUDA L1 means a host-to-device copy).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine_api.sampling import SamplingParams
from engine_api.turn import Finished, FirstToken, GenerationRequest
from kvtier import KVStore, StoreConfig
from local_runner.engine import EmbeddedEngine
from local_runner.loader import LoadedModel, load_model
from proxy.local.config import engine_config
from proxy.settings import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE

from .runner_batch import prompt_ids

MODEL = DEFAULT_MODEL_NAME
MB = 1 << 20


async def turn(
    engine: EmbeddedEngine, ids: list[int], n: int, session: str
) -> tuple[float, int, dict[str, int]]:
    """(TTFT s, reused tokens, reused tokens per tier) of one greedy turn."""
    req = GenerationRequest(
        MODEL, ids, SamplingParams(max_tokens=n, temperature=0), namespace="bench", session=session
    )
    started = time.monotonic()
    job = engine.submit(req)
    ttft, reused, tiers = 0.0, 0, {}
    async for event in job.events():
        if isinstance(event, FirstToken):
            ttft, reused, tiers = event.at - started, event.reused_tokens, event.tiers
        elif isinstance(event, Finished):
            break
    return ttft, reused, tiers


def open_runner(lm: LoadedModel, path: Path, *, l0: int, l1: int, overlap: bool, hint: str) -> EmbeddedEngine:
    store = KVStore(
        StoreConfig(l0, l1, 8 << 30, path, device=lm.device, placement_hint=hint, drop_page_cache=True),
        lm.layout,
        lm.fingerprint,
    )
    return EmbeddedEngine(
        {MODEL: lm},
        {MODEL: store},
        config=engine_config(max_running=4, min_free_memory_bytes=0, overlap_with_compute=overlap),
    ).start()


def second_turn_ttft(
    engine: EmbeddedEngine, lm: LoadedModel, history: int, salt: int
) -> tuple[float, int, dict[str, int]]:
    first = prompt_ids(lm, history, salt)
    asyncio.run(turn(engine, first, 16, f"s{salt}"))
    for store in engine.stores.values():
        store.flush()
    second = first + prompt_ids(lm, 200, salt + 1)
    return asyncio.run(turn(engine, second, 4, f"s{salt}"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tier_policies", description=__doc__.split("\n\n")[0])
    p.add_argument("--history", type=int, default=2000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cache-dir", default="./var/models")
    args = p.parse_args(argv)
    lm = load_model(MODEL, DEFAULT_MODEL_SOURCE, dtype=args.dtype, cache_dir=args.cache_dir)
    print(
        f"model {MODEL} on {lm.device} as {str(lm.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads"
    )
    with tempfile.TemporaryDirectory() as tmp:
        variants = {
            "overlap on (disk only)": open_runner(
                lm, Path(tmp) / "a", l0=0, l1=0, overlap=True, hint="ttft_priority"
            ),
            "overlap off (disk only)": open_runner(
                lm, Path(tmp) / "b", l0=0, l1=0, overlap=False, hint="ttft_priority"
            ),
            "placement ttft_priority": open_runner(
                lm, Path(tmp) / "c", l0=1 << 30, l1=1 << 30, overlap=True, hint="ttft_priority"
            ),
            "placement throughput": open_runner(
                lm, Path(tmp) / "d", l0=1 << 30, l1=1 << 30, overlap=True, hint="throughput"
            ),
        }
        try:
            asyncio.run(turn(next(iter(variants.values())), prompt_ids(lm, 64), 4, "warm"))
            results: dict[str, list[tuple[float, int, dict[str, int]]]] = {k: [] for k in variants}
            for rep in range(args.reps):
                names = list(variants) if rep % 2 == 0 else list(reversed(variants))
                for j, name in enumerate(names):
                    results[name].append(
                        second_turn_ttft(variants[name], lm, args.history, 1000 * rep + 10 * j)
                    )
        finally:
            for r in variants.values():
                r.close()
    print(
        f"\nturn 2 = {args.history}-token history reused + 200 new tokens, {args.reps} interleaved repetitions"
    )
    print("| variant | TTFT median s | reused tokens | from tier |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        tiers = {t: n for t, n in rows[-1][2].items() if n}
        print(f"| {name} | {statistics.median(r[0] for r in rows):.3f} | {rows[-1][1]} | {tiers} |")


if __name__ == "__main__":
    main()
