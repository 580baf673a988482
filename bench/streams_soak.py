"""Rounds of 1 / 4 / 8 / 16 concurrent streams, right after a start and for minutes after: does any round
collapse? (issue 39: 16 streams once ran at 30 tok/s where the same server gave 316-402).

    python -m bench.streams_soak                     # starts `attnstore serve` (settings.json), 10 minutes
    python -m bench.streams_soak --minutes 1 --gaps 0 5    # a quick check that it runs
    python -m bench.streams_soak --url http://127.0.0.1:8080 --pid <server pid>   # a running server

Started here (run it from the checkout, as `attnstore serve`), the server runs ./settings.json as it is
(the defaults: the exact step, bfloat16 where the CPU has it) on a free port, with an L2 folder of its
own; the first round starts as soon as it answers. Each round sends, for every stream count N in turn, N concurrent greedy streams of
`--tokens` tokens (`ignore_eos`) after distinct short prompts, the same prompts every round: the first
round is N misses, every later one N hits on the KV the first one stored (the issue's second round).
Its rate is tokens received / wall clock from the first request to the last byte, prefill, save
hand-off and HTTP included. Between rounds the client is idle for the next of `--gaps` seconds in turn
(0, 20, 75, 150 by default), so rounds run back to back, after a pause, and after minutes of idle.

Printed per round and stream count: tokens/s, the slowest stream's time to first token, the longest
wait between two chunks of one stream, the cache outcomes, and the server's major page faults during
it (what it read back from disk) and the CPU seconds it used (known when the soak started the server
or `--pid` names it), and the machine's load average: a round that took long while the server used
the usual CPU waited for something (the disk, a lock, other processes' work). At the
end, per stream count, the median rate and every round below `--flag` (0.7) times it, flagged. Exit
status 1 when a round is flagged or a request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson

from .streams import stream_request

MODEL = "smollm2-135m-instruct"


@dataclass
class Stream:
    tokens: int
    ttft_s: float
    longest_gap_s: float
    cache: str


@dataclass
class Round:
    index: int
    started_s: float  # since the server answered
    idle_before_s: float
    streams: int
    tok_s: float
    slowest_ttft_s: float
    longest_gap_s: float
    caches: dict[str, int]
    major_faults: int | None  # the server's, during the round
    server_cpu_s: float | None  # the server's CPU seconds during the round
    load: float  # the machine's 1-minute load average as the round ended (others' work included)
    flagged: bool = False


@dataclass
class Soak:
    start_to_ready_s: float | None
    rounds: list[Round] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


async def one_stream(http: aiohttp.ClientSession, url: str, content: str, tokens: int) -> Stream:
    body = stream_request(MODEL, content, tokens)
    started = time.monotonic()
    first: float | None = None
    last = started
    longest = 0.0
    got = 0
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
        cache = r.headers.get("X-AttentionStore-Cache", "?")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            longest = max(longest, now - last)
            last = now
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                got = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            if first is None and choices and choices[0].get("delta", {}).get("content") is not None:
                first = now - started
    return Stream(got, first if first is not None else float("nan"), longest, cache)


@dataclass(frozen=True)
class ProcessTimes:
    """What /proc/PID/stat says of the server: major page faults (pages it waited on the disk for) and
    CPU seconds, both so far."""

    major_faults: int
    cpu_s: float

    @classmethod
    def of(cls, pid: int | None) -> ProcessTimes | None:
        if pid is None:
            return None
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        # fields from the 3rd of stat: majflt is the 12th, utime and stime the 14th and 15th
        return cls(int(fields[9]), (int(fields[11]) + int(fields[12])) / ticks)


async def one_round(
    http: aiohttp.ClientSession, url: str, n: int, tokens: int, pid: int | None
) -> tuple[float, list[Stream], ProcessTimes | None]:
    """(tokens/s, the streams, the server's faults and CPU seconds during the round)."""
    before = ProcessTimes.of(pid)
    started = time.monotonic()
    prompts = [f"Story {n}-{i}: write about the history of computing." for i in range(n)]
    streams = await asyncio.gather(*(one_stream(http, url, p, tokens) for p in prompts))
    rate = sum(s.tokens for s in streams) / (time.monotonic() - started)
    after = ProcessTimes.of(pid)
    spent = None
    if before is not None and after is not None:
        spent = ProcessTimes(after.major_faults - before.major_faults, after.cpu_s - before.cpu_s)
    return rate, list(streams), spent


async def soak(args: argparse.Namespace, url: str, pid: int | None, ready_at: float, report: Soak) -> None:
    deadline = ready_at + args.minutes * 60
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        index = 0
        idle = 0.0
        while True:
            for n in args.streams:
                try:
                    rate, streams, spent = await one_round(http, url, n, args.tokens, pid)
                except Exception as exc:  # a failed request is a finding, not the end of the soak
                    report.failures.append(f"round {index}, {n} streams: {exc}")
                    print(f"round {index} {n:2d} streams: FAILED {exc}", flush=True)
                    continue
                r = Round(
                    index,
                    round(time.monotonic() - ready_at, 1),
                    idle if n == args.streams[0] else 0.0,
                    n,
                    rate,
                    max(s.ttft_s for s in streams),
                    max(s.longest_gap_s for s in streams),
                    dict(Counter(s.cache for s in streams)),
                    spent.major_faults if spent else None,
                    round(spent.cpu_s, 2) if spent else None,
                    os.getloadavg()[0],
                )
                report.rounds.append(r)
                print(
                    f"round {index} at {r.started_s:6.1f} s (idle {r.idle_before_s:5.1f} s before) {n:2d} streams: "
                    f"{rate:6.1f} tok/s, slowest TTFT {r.slowest_ttft_s:5.2f} s, longest gap "
                    f"{r.longest_gap_s:5.2f} s, {dict(r.caches)}; server: CPU {r.server_cpu_s} s, major faults "
                    f"{r.major_faults}; load {r.load:.1f}",
                    flush=True,
                )
            index += 1
            idle = args.gaps[(index - 1) % len(args.gaps)]
            if time.monotonic() + idle >= deadline:
                return
            await asyncio.sleep(idle)


def flag(report: Soak, threshold: float) -> dict[int, float]:
    """Median rate per stream count; rounds below threshold x it are flagged."""
    medians = {}
    for n in sorted({r.streams for r in report.rounds}):
        rates = [r.tok_s for r in report.rounds if r.streams == n]
        medians[n] = statistics.median(rates)
        for r in report.rounds:
            if r.streams == n and r.tok_s < threshold * medians[n]:
                r.flagged = True
    return medians


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(folder: Path, settings_path: Path) -> tuple[subprocess.Popen, str]:
    """`attnstore serve` on the given settings (run from where `attnstore serve` would be: relative paths
    are the current folder's), on a free port with an L2 folder in `folder`."""
    settings = json.loads(settings_path.read_text())
    port = free_port()
    settings["proxy"]["port"] = port
    settings["attention_store"]["tiering"]["l2_disk"]["path"] = str(folder / "kv")
    cache_dir = settings["local_runner"].get("cache_dir", "./var/models")
    settings["local_runner"]["cache_dir"] = str(Path(cache_dir).resolve())  # the models converted already
    path = folder / "settings.json"
    path.write_text(json.dumps(settings))
    env = {k: v for k, v in os.environ.items() if k != "ATTNSTORE_SETTINGS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--settings", str(path)],
        start_new_session=True,  # its own process group: stopped with everything it started
        env=env,
        stdout=open(folder / "server.log", "wb"),  # noqa: SIM115 - the server's life
        stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode})")
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with http.get(url + "/healthz") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"the server did not answer within {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="rounds go on this long after the start")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    p.add_argument(
        "--gaps", type=float, nargs="+", default=[0, 20, 75, 150], help="idle seconds between rounds"
    )
    p.add_argument("--flag", type=float, default=0.7, help="flag a round below this times its median")
    p.add_argument("--settings", type=Path, default=Path("settings.json"), help="the server's settings")
    p.add_argument("--url", help="a running server instead of starting one")
    p.add_argument("--pid", type=int, help="that server's process id (for its page faults)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", type=Path, help="write every round here")
    args = p.parse_args(argv)
    # Stopped from outside (a timeout, Ctrl-C): the server started here goes too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    with tempfile.TemporaryDirectory(prefix="attnstore-streams-soak-") as tmp:
        proc = None
        if args.url:
            url, pid = args.url.rstrip("/"), args.pid
        else:
            proc, url = start_server(Path(tmp), args.settings)
            pid = proc.pid
        t0 = time.monotonic()
        try:
            asyncio.run(wait_ready(url, proc, 600))
            ready = time.monotonic()
            report = Soak(round(ready - t0, 1) if proc is not None else None)
            if proc is not None:
                print(f"server answering {report.start_to_ready_s} s after its start", flush=True)
            asyncio.run(soak(args, url, pid, ready, report))
        finally:
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                if proc.returncode not in (0, -15):
                    print((Path(tmp) / "server.log").read_text()[-3000:], file=sys.stderr)

    medians = flag(report, args.flag)
    print(f"\n| streams | rounds | median tok/s | min | max | flagged (< {args.flag:.1f}x median) |")
    print("|---|---|---|---|---|---|")
    for n, med in medians.items():
        rates = [r.tok_s for r in report.rounds if r.streams == n]
        flagged = [f"round {r.index}: {r.tok_s:.1f}" for r in report.rounds if r.streams == n and r.flagged]
        print(
            f"| {n} | {len(rates)} | {med:.1f} | {min(rates):.1f} | {max(rates):.1f} | {', '.join(flagged) or 'none'} |"
        )
    for failure in report.failures:
        print("FAILED:", failure)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1))
    bad = any(r.flagged for r in report.rounds) or report.failures
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
