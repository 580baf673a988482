"""TTFT of a client with no replica affinity (every turn on the other replica), forwarding on and off.

    python -m bench.replica_forwarding            # --conversations 4 --turns 6 --context-words 600 ...

Starts one redis-server and two pairs of `attnstore serve` replicas on loopback (four processes, the real
local model): one pair with forwarding (`proxy.advertise_url` set: a turn goes to the replica holding its
KV in memory), one without (the turn is served where it lands, from the shared L2: an `l2_hit`). Each pair
has its own L2 folder and Redis database. Conversations are replayed turn by turn, alternating replicas,
the two modes interleaved turn by turn so that both see the same machine load. TTFT is client-measured:
request sent -> response headers (the proxy sends them with the first token). After each turn the bench
waits for the serving replica's L2 writes, as a user's think time would. Prints p50/p90 of the later
turns per mode and the cache levels they reported.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import urllib3

from .support.processes import REPO, UNREACHABLE, ReplicaProcess
from .support.redis_server import REDIS_SERVER, RedisServer
from .support.waiting import wait_until

MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    "Summarize the text above in two sentences.",
    "Which detail in it matters most, and why?",
    "Name one thing the text leaves out.",
    "How would you explain it to a child?",
    "Give it a short title.",
    "What question would you ask its author?",
    "List three keywords for it.",
    "Is there anything in it you disagree with?",
]
FILLER = (
    "The archive kept its records in three rooms: maps in the first, letters in the second, and in the "
    "third the ledgers of a shipping company that traded salt, timber and wool along the northern coast. "
)


def context(words: int, seed: int) -> str:
    text = (f"Document {seed}. " + FILLER * (words // len(FILLER.split()) + 1)).split()
    return " ".join(text[:words])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Pair:
    def __init__(self, workdir: Path, redis_url: str, *, forwarding: bool, threads: int):
        self.label = "forwarding on" if forwarding else "forwarding off"
        tag = "on" if forwarding else "off"
        (workdir / tag).mkdir()
        self.replicas: list[ReplicaProcess] = []
        for name in ("replica-a", "replica-b"):
            settings = {
                "attention_store": {"tiering": {"l2_disk": {"path": str(workdir / tag / "l2")}}},
                "local_runner": {
                    "cache_dir": str(REPO / "var" / "models"),
                    "device": "cpu",
                    "dtype": "float32",
                    "threads": threads,
                },
                "proxy": {"session_index": redis_url, "replica_id": f"{tag}-{name}"},
            }
            self.replicas.append(
                ReplicaProcess(workdir / tag, f"{tag}-{name}", settings, advertise=forwarding)
            )

    def wait_ready(self) -> None:
        for r in self.replicas:
            r.wait_ready(300)

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()


def turn(url: str, session: str, messages: list[dict[str, Any]], max_tokens: int) -> tuple[float, str, dict]:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True}
    sent = time.perf_counter()
    resp = urllib3.request(
        "POST",
        url + "/v1/chat/completions",
        body=orjson.dumps(body),
        headers={
            "Content-Type": "application/json",
            "X-Session-Id": session,
            "Authorization": "Bearer bench",
        },
        timeout=600,
        preload_content=False,
    )
    ttft_ms = (time.perf_counter() - sent) * 1000.0
    if resp.status != 200:
        raise RuntimeError(f"{url} answered {resp.status}: {resp.read()[:300]!r}")
    parts: list[str] = []
    for line in resp.read().split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices", []):
                parts.append((choice.get("delta") or {}).get("content") or "")
    resp.release_conn()
    return ttft_ms, "".join(parts), dict(resp.headers)


def saves_done(url: str) -> bool:
    stats = orjson.loads(urllib3.request("GET", url + "/v1/attention_store/stats", timeout=10).data)
    return stats.get("saves_pending", 0) == 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    if REDIS_SERVER is None:
        raise SystemExit("bench.replica_forwarding needs redis-server (apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix="attnstore-fwd-") as tmp:
        workdir = Path(tmp)
        redis = RedisServer(workdir).start()
        pairs: list[Pair] = []
        try:
            base = redis.url.rsplit("/", 1)[0]
            pairs = [
                Pair(workdir, f"{base}/0", forwarding=True, threads=args.threads),
                Pair(workdir, f"{base}/1", forwarding=False, threads=args.threads),
            ]
            for pair in pairs:
                pair.wait_ready()
            return replay(args, pairs)
        finally:
            for pair in pairs:
                pair.stop()
            redis.stop()


def replay(args: argparse.Namespace, pairs: list[Pair]) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {
        p.label: {"ttft_ms": [], "cache": Counter(), "served_by": Counter()} for p in pairs
    }
    histories: dict[tuple[str, int], list[dict[str, Any]]] = {
        (p.label, c): [] for p in pairs for c in range(args.conversations)
    }
    total = args.conversations * args.turns
    done = 0
    for t in range(args.turns):
        for c in range(args.conversations):
            order = pairs if (t + c) % 2 == 0 else pairs[::-1]
            for pair in order:
                history: list[dict[str, Any]] = histories[(pair.label, c)]
                if not history:
                    history.append({"role": "system", "content": context(args.context_words, c)})
                history.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                replica = pair.replicas[(t + c) % 2]  # no affinity: every turn on the other replica
                ttft_ms, answer, headers = turn(replica.url, f"bench-{c}", history, args.max_tokens)
                history.append({"role": "assistant", "content": answer})
                served = headers.get("X-AttentionStore-Replica", "?")
                server = next(r.url for r in pair.replicas if r.name == served)
                wait_until(functools.partial(saves_done, server), "L2 writes", 120, ignore=UNREACHABLE)
                if t > 0:
                    res = results[pair.label]
                    res["ttft_ms"].append(ttft_ms)
                    res["cache"][headers.get("X-AttentionStore-Cache", "?")] += 1
                    res["served_by"][served] += 1
            done += 1
            print(f"\r{done}/{total} turns", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return results


def report(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| mode | later turns | TTFT p50 ms | TTFT p90 ms | cache levels | served by |",
        "|---|---|---|---|---|---|",
    ]
    for label, res in results.items():
        ttft = res["ttft_ms"]
        cache = ", ".join(f"{k} {v}" for k, v in sorted(res["cache"].items()))
        served = ", ".join(f"{k} {v}" for k, v in sorted(res["served_by"].items()))
        lines.append(
            f"| {label} | {len(ttft)} | {percentile(ttft, 0.5):.1f} | {percentile(ttft, 0.9):.1f} | {cache} | {served} |"
        )
    on, off = (results[k]["ttft_ms"] for k in ("forwarding on", "forwarding off"))
    if on and off:
        lines.append(f"\np50 with forwarding / without: {percentile(on, 0.5) / percentile(off, 0.5):.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6, help="turns per conversation (the first is not counted)")
    p.add_argument("--context-words", type=int, default=600, help="words of the system message of each one")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="torch threads per replica")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    results = run(args)
    print(report(results))
    if args.out:
        args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
