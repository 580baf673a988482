"""One client floods the proxy with oversized prompts; how long does another client wait for its first token?

    python -m bench.abuse [--attackers 6] [--body-mb 8] [--samples 8]

A proxy with the local model runs in this process with two client keys. The victim sends a short chat
(greedy, 8 tokens) `--samples` times while nobody else is there, then again while the attacker keeps
`--attackers` requests in flight, each a single message of `--body-mb` MB (far beyond the context: the
proxy must refuse it before tokenizing, and the per-client limit caps how many it takes at once).
Victim TTFTs are client-measured; the issue's target is a p50 within 2x of idle.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.local.build import load_models
from proxy.settings import DEFAULT_MODEL_NAME, parse_settings

from .multiturn_servers import InProcessTarget

MODEL = DEFAULT_MODEL_NAME


async def victim_ttft(http: aiohttp.ClientSession, url: str, i: int) -> float:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Name a color. ({i})"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    async with http.post(url, json=body, headers={"Authorization": "Bearer victim"}) as resp:
        async for _ in resp.content.iter_any():
            return time.perf_counter() - started
    return time.perf_counter() - started


async def attack(
    http: aiohttp.ClientSession, url: str, body: bytes, stop: asyncio.Event, counts: dict
) -> None:
    headers = {"Authorization": "Bearer attacker", "Content-Type": "application/json"}
    while not stop.is_set():
        try:
            async with http.post(url, data=body, headers=headers) as resp:
                await resp.read()
                counts[resp.status] = counts.get(resp.status, 0) + 1
        except aiohttp.ClientError:
            counts["error"] = counts.get("error", 0) + 1


async def attacker_process(url: str, attackers: int, body_mb: int, seconds: float) -> dict:
    """The attacking client, in a process of its own (its own work must not slow the server down)."""
    content = "word " * (body_mb * (1 << 20) // 5)
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})
    counts: dict = {}
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        tasks = [asyncio.ensure_future(attack(http, url, body, stop, counts)) for _ in range(attackers)]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
    return counts


def _attack_main(url: str, attackers: int, body_mb: int, seconds: float, out: Any) -> None:
    out.put(asyncio.run(attacker_process(url, attackers, body_mb, seconds)))


async def run(url: str, args: argparse.Namespace) -> tuple[list[float], list[float], dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        await victim_ttft(http, url, -1)  # warm-up
        idle = [await victim_ttft(http, url, i) for i in range(args.samples)]
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        proc = ctx.Process(
            target=_attack_main, args=(url, args.attackers, args.body_mb, args.seconds, results)
        )
        proc.start()
        await asyncio.sleep(3.0)  # the attacker process is up and its requests are in flight
        loaded = [await victim_ttft(http, url, 100 + i) for i in range(args.samples)]
        counts = await asyncio.to_thread(results.get)
        proc.join()
    return idle, loaded, counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.abuse", description=__doc__.split("\n\n")[0])
    p.add_argument("--attackers", type=int, default=6)
    p.add_argument("--body-mb", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seconds", type=float, default=15.0, help="how long the attacker process runs")
    p.add_argument(
        "--read-oversized",
        action="store_true",
        help="baseline: read and parse oversized bodies before refusing them (no refusal by Content-Length)",
    )
    args = p.parse_args(argv)
    if args.read_oversized:
        import proxy.http.limits

        proxy.http.limits.BODY_BYTES_PER_CONTEXT_TOKEN = 1 << 40  # the size check never fires
    with tempfile.TemporaryDirectory() as tmp:
        raw = {
            "attention_store": {"tiering": {"l2_disk": {"path": str(Path(tmp) / "kv")}}},
            "proxy": {"port": 0, "api_keys": ["victim", "attacker"], "max_body_mb": 16, "log_level": "error"},
        }
        settings = parse_settings(orjson.dumps(raw), Path.cwd(), env={})
        target = InProcessTarget(settings, load_models(settings), Path.cwd()).start()
        try:
            idle, loaded, counts = asyncio.run(run(target.url, args))
        finally:
            target.stop()
    p50_idle, p50_loaded = statistics.median(idle), statistics.median(loaded)
    print(
        f"victim TTFT p50: idle {p50_idle * 1000:.0f} ms, under attack {p50_loaded * 1000:.0f} ms "
        f"({p50_loaded / p50_idle:.2f}x); max under attack {max(loaded) * 1000:.0f} ms"
    )
    print(f"attacker answers ({args.attackers} in flight, {args.body_mb} MB each): {counts}")


if __name__ == "__main__":
    main()
