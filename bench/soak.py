"""A bounded soak of the proxy with the local model and faults injected (issue 13).

    python -m bench.soak                                  # 30 sessions x 5 turns at concurrency 4
    python -m bench.soak --sessions 3 --turns 2           # a quick check that it runs

One process: a throw-away redis-server (the session index), the proxy with the local model (small L0 and
L1 so the tiers fill and spill to L2), and a client running `--sessions` conversations of `--turns`
turns, `--concurrency` at a time (greedy, short answers). Faults, each once, when half the turns are
done: Redis is restarted (its records are lost), one L2 file is corrupted (a byte flipped in its
tensor data), and one streamed turn is cancelled by its client after its first chunk (the session goes
on with its next turn).

It fails (exit 1) unless:
- no request failed (every turn answered 200, the cancelled one excepted);
- every later turn (turn >= 1) is a hit, except at most one per session whose chunk was the corrupted
  file (that turn may be a miss; it is reported);
- a sample of `--sample` turns equals a full recompute (the same messages from another tenant, whose
  KV is never shared, so nothing is reused);
- RSS is flat once the tiers are full: its peak after the memory tiers first reach 90% of capacity is
  at most `--rss-margin-mb` above its value then, and the overall peak is at most the RSS after the
  model loaded + L0 + L1 capacity + that margin (default 256 MB: allocator slack, the tokenizer pool,
  buffers of the jobs in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

MB = 1024 * 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Report:
    failed: list[str] = field(default_factory=list)
    later_turns: int = 0
    later_misses: list[str] = field(default_factory=list)
    compared: int = 0
    mismatches: list[str] = field(default_factory=list)
    rss: list[tuple[float, int, bool]] = field(default_factory=list)  # (time, rss, tiers full)
    cancelled: int = 0


async def chat(http: aiohttp.ClientSession, url: str, body: dict, key: str) -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        raw = await resp.read()
        return resp.status, dict(resp.headers), orjson.loads(raw) if raw else {}


async def cancel_one_stream(http: aiohttp.ClientSession, url: str, body: dict, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(
        url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers
    ) as resp:
        await resp.content.readline()  # the first event; then the client goes away


def tiers_full(stats: dict, capacity: int) -> bool:
    tiers = stats.get("tiers") or {}
    used = sum(tiers.get(t, {}).get("used_bytes", 0) for t in ("l0", "l1"))
    return capacity > 0 and used >= 0.9 * capacity


async def run(args: argparse.Namespace, url: str, faults, l2_root: Path, capacity: int) -> Report:
    rep = Report()
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.concurrency)
    done_turns = 0
    total = args.sessions * args.turns
    fault_fired = False
    full_seen = False
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def sample_rss() -> None:
            nonlocal full_seen
            async with http.get(url + "/v1/attention_store/stats") as r:
                stats = await r.json()
            full_seen = full_seen or tiers_full(stats, capacity)
            rep.rss.append((time.monotonic(), rss_bytes(), full_seen))

        async def session(i: int) -> None:
            nonlocal done_turns, fault_fired
            key = f"soak-{i}"
            messages: list[dict] = [{"role": "system", "content": f"You are assistant number {i}."}]
            for t in range(args.turns):
                messages.append({"role": "user", "content": f"Question {t} of session {i}: name a colour."})
                body = {"model": args.model, "messages": messages, "max_tokens": args.max_tokens}
                body["temperature"] = 0
                async with sem:
                    if i == 0 and t == 1 and args.turns > 2:  # the cancelled stream, then the real turn
                        await cancel_one_stream(http, url, body, key)
                        rep.cancelled += 1
                    status, headers, doc = await chat(http, url, body, key)
                    done_turns += 1
                    if not fault_fired and done_turns >= total // 2:
                        fault_fired = True
                        await asyncio.to_thread(faults, l2_root)
                    await sample_rss()
                if status != 200:
                    rep.failed.append(f"session {i} turn {t}: {status} {doc}")
                    return
                answer = doc["choices"][0]["message"]["content"]
                if t >= 1:
                    rep.later_turns += 1
                    if headers.get("X-AttentionStore-Cache") == "miss":
                        rep.later_misses.append(f"session {i} turn {t}")
                if rng.random() < args.sample / max(1, total):
                    async with sem:
                        s2, _, d2 = await chat(http, url, body, f"recompute-{i}-{t}")
                    rep.compared += 1
                    if s2 != 200 or d2["choices"][0]["message"]["content"] != answer:
                        rep.mismatches.append(f"session {i} turn {t}")
                messages.append({"role": "assistant", "content": answer})

        await asyncio.gather(*(session(i) for i in range(args.sessions)))
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=30)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--sample", type=int, default=10, help="turns compared with a full recompute")
    p.add_argument("--l0-mb", type=float, default=8)
    p.add_argument("--l1-mb", type=float, default=16)
    p.add_argument("--rss-margin-mb", type=float, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from proxy.http.app import build_full_app
    from proxy.settings import DEFAULT_MODEL_NAME, parse_settings
    from proxy.turns.local_start import LOCAL_START

    from .support.redis_server import REDIS_SERVER, RedisServer
    from .support.threaded_server import AppServer

    args.model = DEFAULT_MODEL_NAME
    if REDIS_SERVER is None:
        print("soak: redis-server is not installed", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="attnstore-soak-") as tmp:
        work = Path(tmp)
        redis = RedisServer(work).start()
        raw = {
            "attention_store": {
                "tiering": {
                    "l0_gpu": {"capacity_mb": args.l0_mb},
                    "l1_host": {"capacity_mb": args.l1_mb},
                    "l2_disk": {"path": str(work / "kv")},
                }
            },
            "local_runner": {"enabled": True, "device": "cpu", "max_queue": 64},
            "proxy": {"session_index": redis.url},
        }
        settings = parse_settings(orjson.dumps(raw), Path.cwd(), env={})
        app = build_full_app(settings)
        server = AppServer(app, start_timeout_s=300).start()
        # The baseline is the server as started: the model and the engine's fixed buffers (its KV page
        # pool); what serving adds beyond it must stay within the tiers' capacity and the margin.
        server.call(app[LOCAL_START].wait(), timeout=300)
        rss_started = rss_bytes()
        capacity = int((args.l0_mb + args.l1_mb) * MB)

        def faults(l2_root: Path) -> None:
            redis.stop()
            redis.start()  # same port, empty: the session index lost every record
            files = sorted(l2_root.rglob("*.safetensors"))
            files = [f for f in files if "quarantine" not in f.parts]
            if files:
                victim = files[len(files) // 2]
                data = bytearray(victim.read_bytes())
                data[-10] ^= 0x01
                victim.write_bytes(bytes(data))
                print(f"soak: corrupted {victim.name}", file=sys.stderr)

        start = time.monotonic()
        try:
            rep = asyncio.run(run(args, server.url, faults, work / "kv", capacity))
        finally:
            server.stop()
            redis.stop()
    elapsed = time.monotonic() - start
    full = [r for _, r, f in rep.rss if f]
    rss_at_full = full[0] if full else None
    peak = max((r for _, r, _ in rep.rss), default=0)
    margin = args.rss_margin_mb * MB
    problems = list(rep.failed)
    if len(rep.later_misses) > 1:
        problems.append(f"later turns that missed: {rep.later_misses} (at most 1 allowed: the corrupt file)")
    problems += [f"answer differs from a recompute: {m}" for m in rep.mismatches]
    if rss_at_full is not None and max(full) > rss_at_full + margin:
        problems.append(f"RSS grew by {(max(full) - rss_at_full) / MB:.0f} MB after the tiers were full")
    if peak > rss_started + capacity + margin:
        problems.append(f"RSS peak {peak / MB:.0f} MB > started + L0 + L1 + margin")
    print(
        f"soak: {args.sessions} sessions x {args.turns} turns at concurrency {args.concurrency} in "
        f"{elapsed:.0f} s; later turns {rep.later_turns}, misses {len(rep.later_misses)}; compared "
        f"{rep.compared} with a recompute; cancelled {rep.cancelled}; RSS after start "
        f"{rss_started / MB:.0f} MB, when tiers full "
        f"{'-' if rss_at_full is None else f'{rss_at_full / MB:.0f} MB'}, peak {peak / MB:.0f} MB"
    )
    for line in problems:
        print(f"soak: FAIL {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
