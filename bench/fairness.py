"""Fair admission, measured: one client floods the server, another sends a single turn.

    python -m bench.fairness --url http://127.0.0.1:8080 [--flood 28] [--tokens 64] [--reps 3]

Client B's time to first token is measured alone, then while client A (another API key) keeps `--flood`
streamed requests in flight (more than the running slots, so A's jobs wait in the queue). With one
FIFO queue B would wait behind every job A queued before it; with per-client round-robin admission it
waits for the next free slot only. Also counts A's answers by status (a client alone may fill the whole
queue: no 429 unless another client waits while A is over its share). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter

import aiohttp


async def ttft(
    http: aiohttp.ClientSession, url: str, key: str, content: str, tokens: int
) -> tuple[int, float]:
    """(status, seconds to the first streamed token; nan when refused) of one streamed turn."""
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    started = time.monotonic()
    async with http.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        if r.status != 200:
            await r.read()
            return r.status, float("nan")
        first: float | None = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - started
        return r.status, float("nan") if first is None else first


async def run(args: argparse.Namespace) -> None:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        await ttft(http, args.url, "bench-b", "Hello.", 2)  # warm-up
        alone = [
            (await ttft(http, args.url, "bench-b", f"Question {i}: what is a cache?", 16))[1]
            for i in range(3)
        ]
        loaded: list[float] = []
        flood_ttfts: list[float] = []
        statuses: Counter[int] = Counter()
        for rep in range(args.reps):
            flood = [
                asyncio.ensure_future(
                    ttft(http, args.url, "bench-a", f"Flood {rep}-{i}: write about computing.", args.tokens)
                )
                for i in range(args.flood)
            ]
            await asyncio.sleep(args.delay)  # A's jobs fill the slots and wait in the queue
            status, seconds = await ttft(http, args.url, "bench-b", f"Question {rep}: what is a cache?", 16)
            assert status == 200, f"client B was refused ({status})"
            loaded.append(seconds)
            answers = await asyncio.gather(*flood)
            statuses.update(s for s, _ in answers)
            flood_ttfts += [t for s, t in answers if s == 200]
    print(f"client B's TTFT alone: median {statistics.median(alone):.2f} s")
    print(
        f"client B's TTFT while client A keeps {args.flood} streams of {args.tokens} tokens in flight: "
        f"median {statistics.median(loaded):.2f} s (each rep: {', '.join(f'{x:.2f}' for x in loaded)})"
    )
    queued = sorted(flood_ttfts)[-(len(flood_ttfts) // 3) :]  # A's latest third: queued before B came
    print(
        f"client A's TTFT: median {statistics.median(flood_ttfts):.2f} s; its latest third, queued before B "
        f"arrived (FIFO would have served them first): median {statistics.median(queued):.2f} s"
    )
    print(f"client A's answers by status: {dict(sorted(statuses.items()))}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--flood", type=int, default=28, help="client A's requests in flight")
    p.add_argument("--tokens", type=int, default=64, help="tokens per answer of client A")
    p.add_argument("--delay", type=float, default=2.0, help="seconds between A's flood and B's turn")
    p.add_argument("--reps", type=int, default=3)
    asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()
