"""The engine side by side with any OpenAI-compatible server: N concurrent greedy streams of a fixed
length after a short prompt (aggregate tokens/s by wall clock, prefill included), and the time to first
token of a long prompt that nothing is reused for.

    python -m bench.streams --target attnstore=http://127.0.0.1:8080 --target vllm=http://127.0.0.1:8100 \\
        --streams 1 4 8 16 --reps 3 --json streams.json

Each server must already run, alone on the machine while it is measured. A server that just answered is
not idle at once (vLLM CPU keeps its cores busy for seconds after a burst: attnstore measured 0.6x
of its own rate at 1-4 streams right after vLLM's turn), so give each server's process group with `--pause
label=PGID`: the others are stopped (SIGSTOP) while one is measured and resumed after. The servers are
interleaved: for every stream count, every server in turn, `--reps` times, and the median is reported. Answers are forced to `--tokens` tokens with
`ignore_eos` (vLLM's extension; attnstore serves it too), so every server decodes the same amount.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass

import aiohttp
import orjson

WORDS = tuple(
    [
        "the",
        "history",
        "of",
        "computing",
        "is",
        "a",
        "story",
        "of",
        "layers",
        "each",
        "generation",
        "of",
        "machines",
        "hides",
        "the",
        "details",
        "of",
        "the",
        "one",
        "below",
        "it",
        "and",
        "every",
        "abstraction",
        "makes",
        "the",
        "next",
        "one",
        "possible",
        "rivers",
        "mountains",
        "oceans",
        "bridges",
    ]
)


@dataclass
class StreamResult:
    tokens: int
    ttft_s: float


def stream_request(model: str, content: str, max_tokens: int) -> dict:
    """One greedy streamed chat of exactly `max_tokens` tokens (ignore_eos), its usage at the end."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


async def one_stream(
    http: aiohttp.ClientSession, url: str, model: str, content: str, max_tokens: int
) -> StreamResult:
    body = stream_request(model, content, max_tokens)
    started = time.monotonic()
    first: float | None = None
    tokens = 0
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:200]!r}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            if first is None and choices and choices[0].get("delta", {}).get("content") is not None:
                first = time.monotonic() - started
    return StreamResult(tokens, first if first is not None else float("nan"))


async def streams_rate(
    http: aiohttp.ClientSession, url: str, model: str, n: int, tokens: int, salt: int
) -> float:
    """Aggregate tokens/s of n concurrent streams, by wall clock from the first request sent to the
    last token received (every prompt distinct: nothing is reused)."""
    started = time.monotonic()
    results = await asyncio.gather(
        *(
            one_stream(http, url, model, f"Story {salt}-{i}: write about the history of computing.", tokens)
            for i in range(n)
        )
    )
    return sum(r.tokens for r in results) / (time.monotonic() - started)


def long_prompt(words: int, seed: int) -> str:
    rnd = random.Random(seed)
    return f"Document {seed}. " + " ".join(rnd.choice(WORDS) for _ in range(words))


class Alone:
    """Stops every other server's process group (SIGSTOP) while one is measured; resumes all at the end."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups

    def only(self, name: str) -> None:
        for other, pgids in self.groups.items():
            for pgid in pgids:
                os.killpg(pgid, signal.SIGCONT if other == name else signal.SIGSTOP)

    def resume_all(self) -> None:
        for pgid in (p for pgids in self.groups.values() for p in pgids):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)


async def run(args: argparse.Namespace) -> dict:
    alone = Alone(
        {label: [int(p) for p in pgids.split(",")] for label, pgids in (g.split("=", 1) for g in args.pause)}
    )
    try:
        return await _run(args, alone)
    finally:
        alone.resume_all()


async def _run(args: argparse.Namespace, alone: Alone) -> dict:
    targets = [t.split("=", 1) for t in args.target]
    rates: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.streams} for name, _ in targets}
    ttfts: dict[str, list[float]] = {name: [] for name, _ in targets}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    # A connection per request: a server resumed from a pause (--pause) may close idle connections
    # under a request being written.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        for name, url in targets:  # warm-up: first requests pay one-time costs on every server
            alone.only(name)
            await one_stream(http, url, args.model, "Hello there.", 4)
        salt = random.randrange(1 << 30)
        for rep in range(args.reps):
            for n in args.streams:
                for name, url in targets if rep % 2 == 0 else list(reversed(targets)):
                    salt += 1
                    alone.only(name)
                    rates[name][n].append(await streams_rate(http, url, args.model, n, args.tokens, salt))
                    print(f"rep {rep} {name} {n} streams: {rates[name][n][-1]:.1f} tok/s", flush=True)
            for name, url in targets if rep % 2 == 0 else list(reversed(targets)):
                salt += 1
                alone.only(name)
                r = await one_stream(http, url, args.model, long_prompt(args.long_words, salt), 1)
                ttfts[name].append(r.ttft_s)
                print(f"rep {rep} {name} long prompt TTFT {r.ttft_s:.2f} s", flush=True)
    return {
        "streams": args.streams,
        "tokens": args.tokens,
        "servers": {
            name: {
                "tok_s": {str(n): statistics.median(v) for n, v in rates[name].items()},
                "long_prompt_ttft_s": statistics.median(ttfts[name]),
            }
            for name, _ in targets
        },
    }


def table(result: dict) -> str:
    names = list(result["servers"])
    lines = ["| streams | " + " | ".join(names) + (" | ratio |" if len(names) == 2 else " |")]
    lines.append("|---" * (len(names) + 1 + (len(names) == 2)) + "|")
    for n in result["streams"]:
        vals = [result["servers"][name]["tok_s"][str(n)] for name in names]
        row = f"| {n} | " + " | ".join(f"{v:.1f}" for v in vals)
        lines.append(row + (f" | {vals[0] / vals[1]:.2f} |" if len(vals) == 2 else " |"))
    ttft = [result["servers"][name]["long_prompt_ttft_s"] for name in names]
    lines.append(
        "| long prompt TTFT (s) | "
        + " | ".join(f"{v:.2f}" for v in ttft)
        + (" | |" if len(names) == 2 else " |")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", required=True, help="label=URL of a running server")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--long-words", type=int, default=1500, help="words of the long prompt (~2,000 tokens)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument(
        "--pause",
        action="append",
        default=[],
        help="label=PGID[,PGID...]: that server's process groups (attnstore on vLLM: the proxy's and its "
        "vLLM's), stopped while another server is measured",
    )
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print(table(result))
    if args.json:
        with open(args.json, "wb") as fh:
            fh.write(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
