"""`attnstore bench`: replay ShareGPT conversations and measure TTFT and prefill cost with and without reuse.

    attnstore bench --conversations 8 --min-turns 4 --concurrency 1      # python -m bench.multiturn does the same

By default it starts two proxies in this process, sharing one loaded model: one with the attention
store, one with `attention_store.enabled: false` (the recompute baseline). The same conversations run
against both, interleaved round by round (each round sends the next turn of every active session, to one
proxy and then the other, alternating which goes first), so noise on a shared machine hits both alike.
`--target URL` replays the same workload against any OpenAI-compatible server instead.

With `--peer URL` (or `--sessions S`) it runs the paper's many-sessions workload instead, against this
attnstore and the servers a user runs now, side by side: see bench/peers.py.

Each turn sends the whole history, streamed, as a real client does; the assistant messages are the
answers that target gave. After a round's requests have finished, the bench measures the ideal for each
reuse turn (prefill of only its new tokens on an in-memory cache, same model) so it never competes with
the servers for the CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .multiturn_client import ChatError, ChatResult, stream_chat
from .multiturn_options import BenchOptions, check, output_path, parser
from .multiturn_report import TurnRecord, from_l2, plot, report_dict, scheduler_table, table, write_json
from .multiturn_servers import Target
from .multiturn_setup import load_base_settings, machine_meta, prepare_conversations, store_stats
from .sharegpt import Conversation

__all__ = ["BenchOptions", "main", "parser", "run_bench"]


@dataclass
class _Session:
    """One conversation as one mode's client sees it: the history it has built so far."""

    slot: int
    conv: Conversation
    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0
    prev_context: int = 0  # previous prompt + answer tokens


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
        targets: Sequence[Target],
        l2_dir: Path | None,
        chunk_tokens: int,
    ):
        from engine_api.prompt import render_prompt

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
        self, http: aiohttp.ClientSession, t: Target, s: _Session, rnd: int, single: bool
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
            cached_tokens=res.cached_tokens,
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

    async def _warm_up(self, http: aiohttp.ClientSession, t: Target) -> None:
        """One short request under another key (another tenant, so it cannot give anyone a hit): the
        first request pays one-time costs that would otherwise land on the first measured turn."""
        body = {"model": self.o.model or self.lm.name, "messages": [{"role": "user", "content": "Hi"}]}
        await stream_chat(http, t.url, {**body, "max_tokens": 2, "temperature": 0}, api_key="bench-warm-up")


def run_bench(options: BenchOptions, models: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the report (also written as JSON, and as a PNG plot unless disabled).

    `models` (served name -> local_runner.loader.LoadedModel) skips loading, e.g. in tests.
    """
    from tqdm import tqdm

    from .multiturn_servers import start_targets

    if options.many_sessions:
        from .peers import run_many_sessions

        return run_many_sessions(options, models)
    started = time.perf_counter()
    base_dir = Path.cwd()
    base = load_base_settings(options)
    with contextlib.ExitStack() as stack:
        s = start_targets(options, base, base_dir, stack, models)
        targets = s.targets
        name = options.model or next(iter(s.models))
        lm = s.models[name]
        convs = prepare_conversations(
            options, lm.tokenizer, options.conversations, options.min_turns, options.max_turns
        )
        replay = _Replay(options, lm, targets, s.l2_dir, s.chunk_tokens)
        total = sum(c.turns for c in convs) * len(targets)
        with tqdm(
            total=total, desc="turns", unit="turn", file=sys.stderr, disable=not options.progress
        ) as bar:
            asyncio.run(replay.run(convs, bar))
        stats = asyncio.run(store_stats({t.mode: t.base for t in targets}))
    meta = machine_meta(options, lm, convs, time.perf_counter() - started)
    meta["ended_by_context"] = replay.ended_by_context
    meta["store_stats"] = stats
    report = report_dict(meta, replay.records)
    json_path = output_path(options, f"multiturn-c{options.concurrency}-{options.tiers}-s{options.seed}")
    write_json(json_path, report)
    png = json_path.with_suffix(".png")
    if options.plot:
        title = f"{len(convs)} ShareGPT conversations, concurrency {options.concurrency}, tiers {options.tiers}, {name}"
        plot(png, replay.records, title)
    report["paths"] = {"json": str(json_path), "png": str(png) if options.plot else None}
    return report


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    options = BenchOptions(**vars(args), argv=argv)
    problem = check(options)
    if problem:
        print(f"attnstore bench: {problem}", file=sys.stderr)
        return 2
    from proxy.settings import SettingsError

    try:
        report = run_bench(options)
    except (ChatError, FileNotFoundError, SettingsError, aiohttp.ClientError) as exc:
        print(f"attnstore bench: {exc}", file=sys.stderr)
        return 1
    if options.many_sessions:
        from .peers_report import servers_table

        print(servers_table(report))
    else:
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
