"""What the proxy adds on the upstream path: latency per request and throughput, direct vs proxied.

    python -m bench.proxy_overhead [--requests 2000] [--concurrency 32] [--seconds 3] [--rounds 3]

Starts the fake upstream (bench.support.fake_upstream) and the proxy (`python -m proxy serve`) as two processes
on loopback, then from this process:
  1. sequential latency: the same small chat request alternately direct and through the proxy
     (non-streamed and streamed, the stream read to its end), p50/p99 of each and the difference;
  2. throughput: N concurrent aiohttp clients for a few seconds, direct and proxied rounds interleaved.
Targets: p50 added latency < 1 ms; proxied throughput >= half of direct.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from .support.threaded_server import free_port

ROOT = Path(__file__).resolve().parents[1]
BODY = {"model": "gpt-fake", "messages": [{"role": "user", "content": "Say hello."}]}


def start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT
    )


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            async with session.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(url)


async def one(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return (time.perf_counter() - t0) * 1000.0


def cpu_s(proc: subprocess.Popen) -> float:
    """User + system CPU seconds the process has used so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def latency(session, direct: str, proxied: str, body: bytes, n: int) -> dict[str, list[float]]:
    for _ in range(50):  # warm-up: connections, caches
        await one(session, direct, body)
        await one(session, proxied, body)
    out: dict[str, list[float]] = {"direct": [], "proxied": []}
    for i in range(n):
        order = (
            (("direct", direct), ("proxied", proxied))
            if i % 2
            else (("proxied", proxied), ("direct", direct))
        )
        for name, url in order:
            out[name].append(await one(session, url, body))
    return out


async def throughput(url: str, body: bytes, concurrency: int, seconds: float) -> float:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        done = 0
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await one(session, url, body)
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


async def run(args: argparse.Namespace) -> int:
    load0 = os.getloadavg()[0]
    up_port, px_port = free_port(), free_port()
    tmp = Path(tempfile.mkdtemp(prefix="attnstore-overhead-"))
    settings = {
        "attention_store": {"tiering": {"l2_disk": {"path": str(tmp / "kv")}}},
        "llm_endpoint": {"base_url": f"http://127.0.0.1:{up_port}/v1", "api_key_env": "", "model": ""},
        "local_runner": {"enabled": False},
        "proxy": {"log_level": args.log_level},
    }
    (tmp / "settings.json").write_bytes(orjson.dumps(settings))
    upstream = start(["-m", "bench.support.fake_upstream", "--port", str(up_port)])
    proxy = start(["-m", "proxy", "serve", "--settings", str(tmp / "settings.json"), "--port", str(px_port)])
    try:
        direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
        proxied = f"http://127.0.0.1:{px_port}/v1/chat/completions"
        rows = []
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, f"http://127.0.0.1:{up_port}/v1/models", upstream)
            await wait_ready(session, f"http://127.0.0.1:{px_port}/healthz", proxy)
            for label, body in (("non-streamed", BODY), ("streamed", {**BODY, "stream": True})):
                lat = await latency(session, direct, proxied, orjson.dumps(body), args.requests)
                d50, p50 = statistics.median(lat["direct"]), statistics.median(lat["proxied"])
                d99, p99 = pct(lat["direct"], 99), pct(lat["proxied"], 99)
                rows.append((f"latency {label} p50 (ms)", d50, p50, p50 - d50))
                rows.append((f"latency {label} p99 (ms)", d99, p99, p99 - d99))
        body = orjson.dumps(BODY)
        rps: dict[str, list[float]] = {"direct": [], "proxied": []}
        proxy_cpu, proxied_reqs = 0.0, 0.0
        for _ in range(args.rounds):
            rps["direct"].append(await throughput(direct, body, args.concurrency, args.seconds))
            c0 = cpu_s(proxy)
            t0 = time.perf_counter()
            rps["proxied"].append(await throughput(proxied, body, args.concurrency, args.seconds))
            proxied_reqs += rps["proxied"][-1] * (time.perf_counter() - t0)
            proxy_cpu += cpu_s(proxy) - c0
        d, p = statistics.median(rps["direct"]), statistics.median(rps["proxied"])
        rows.append((f"throughput c={args.concurrency} (req/s)", d, p, p - d))
        # The machine-independent part: what one proxied request costs the proxy process in CPU.
        cpu_ms = proxy_cpu / proxied_reqs * 1000 if proxied_reqs else float("nan")
        rows.append(("proxy CPU per request (ms)", 0.0, cpu_ms, cpu_ms))
    finally:
        for proc in (proxy, upstream):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    print(f"loop: {loop_name()}; load average at start: {load0:.2f} on {os.cpu_count()} cores")
    print(
        f"proxy overhead: {args.requests} sequential requests per mode, {args.rounds} x {args.seconds}s rounds"
    )
    print(f"{'':34} {'direct':>10} {'proxied':>10} {'added':>10}")
    for name, a, b, diff in rows:
        print(f"{name:34} {a:10.3f} {b:10.3f} {diff:+10.3f}")
    added_p50 = rows[0][3]
    ratio = p / d if d else 0.0
    print(
        f"\nadded p50 (non-streamed): {added_p50:.3f} ms (target < 1 ms): {'ok' if added_p50 < 1 else 'MISSED'}"
    )
    print(f"proxied/direct throughput: {ratio:.2f} (target >= 0.5): {'ok' if ratio >= 0.5 else 'MISSED'}")
    return 0


def loop_name() -> str:
    try:
        import uvloop

        return f"uvloop {uvloop.__version__} in the proxy"
    except ImportError:
        return "asyncio (install uvloop for less overhead)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="sequential requests per mode and kind")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=3.0, help="length of one throughput round")
    p.add_argument("--rounds", type=int, default=3, help="direct/proxied throughput rounds (interleaved)")
    p.add_argument("--log-level", default="info", help="the proxy's log level (info logs every request)")
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
