"""Retention for agents against plain LRU, measured on the engine (no HTTP): agent loops whose turns end
in tool calls, beside ordinary chats, with fast memory too small for everyone.

    python -m bench.agents [--quick] [--agents 4] [--chats 6] [--turns 6] [--chat-turns 2] [--reps 2]
        [--l2-mb 16384 | --l2-mb 0]

Rounds: every agent sends its history (a system prompt, its task, every tool result so far) and gets an
answer (standing for a tool call); then its tool runs, and while it does every chat takes
`--chat-turns` turns (a user message of `--chat-tokens` more each, a new conversation past `--chat-max`
tokens; at least `--pause` seconds go by), so new KV arrives while the agents wait, as much in every
run whatever the machine's speed; then each agent comes back with a ~`--tool-tokens` result. L0 holds
`--fit` times the agents' working set (their longest histories) plus what the chats pin while they run
(their longest histories: a running job's chunks are never evicted), L1 nothing; L2 is a disk whose
files are dropped from the page cache once written (`--l2-mb`; 0: no L2, so what LRU gives up is
recomputed). The chats touch their whole history every turn, so under LRU the waiting agents are the
least recently used: what an agent loses while its tool runs.

Variants, interleaved in one run (each repetition on a fresh store, the order alternating):
`retention`: after each turn that ends in tool calls the engine retains the session for
`attention_store.retention.tool_call_wait_s` (what the serving layer does, proxy/serving/retention.py);
`lru`: nothing is retained (`attention_store.retention.enabled: false`).

Printed: per agent turn after a pause, the cached share (reused / prompt tokens) and the share served
from the fastest tier (every reused token from L0); TTFT p50/p90 of those agent turns and of the chat
turns; the ratios retention / LRU against the issue's goals (from L0 >= 90% with retention, agent TTFT
p50 <= 0.5x LRU, chat TTFT no worse than 1.2x).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_api.sampling import SamplingParams
from engine_api.turn import Finished, FirstToken, GenerationRequest
from kvtier import KVStore, StoreConfig
from local_runner.engine import EmbeddedEngine
from local_runner.loader import LoadedModel, load_model
from proxy.local.config import engine_config
from proxy.serving.retention import RetentionPolicy
from proxy.settings import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SOURCE, Settings

from .runner_batch import prompt_ids

MODEL = DEFAULT_MODEL_NAME
NAMESPACE = "bench"
MB = 1 << 20
VARIANTS = ("retention", "lru")
CHUNK_TOKENS = StoreConfig.chunk_tokens  # the store's chunk (the default the benchmark runs with)
GOAL_FASTEST = 0.9  # agent turns after a tool pause served from the fastest tier, with retention
GOAL_AGENT_TTFT = 0.5  # agent TTFT p50, retention / LRU
GOAL_CHAT_TTFT = 1.2  # chat TTFT p50, retention / LRU


@dataclass
class Workload:
    agents: int
    chats: int
    turns: int
    pause_s: float
    system_tokens: int
    tool_tokens: int
    answer_tokens: int
    chat_tokens: int
    chat_max: int
    chat_turns: int  # turns each chat takes while the agents' tools run

    def agent_history(self) -> int:
        """An agent's longest prompt: its system prompt and task, and every tool result but the last."""
        return self.system_tokens + 64 + (self.turns - 1) * self.tool_tokens + self.answer_tokens

    def chat_pins(self) -> int:
        """Tokens the running chats hold pinned at most (each its longest history and answer)."""
        return self.chats * (self.chat_max + self.answer_tokens)


@dataclass
class Turn:
    ttft_s: float
    prompt: int
    reused: int
    tiers: dict[str, int]
    reusable: int = 0  # what the store could give: the previous turn's prompt (an agent's; 0: none)

    @property
    def fastest(self) -> bool:
        """The turn's history came back from L0: every reused token from L0, and all of the previous
        prompt but its last, partly filled chunk at most (a turn that lost its history and recomputed
        it reuses little, however fast)."""
        return (
            self.reusable > 0
            and self.tiers.get("l0", 0) >= self.reusable - CHUNK_TOKENS
            and not any(n for t, n in self.tiers.items() if t != "l0")
        )


@dataclass
class Result:
    agent: dict[int, list[Turn]] = field(default_factory=dict)  # turn index (>= 1) -> turns
    chat: list[Turn] = field(default_factory=list)
    retention_evictions: int = 0


async def one_turn(engine: EmbeddedEngine, ids: list[int], n: int, session: str) -> Turn:
    """One greedy turn: its TTFT (submitted -> first token) and what it reused from which tier."""
    req = GenerationRequest(
        MODEL, ids, SamplingParams(max_tokens=n, temperature=0), namespace=NAMESPACE, session=session
    )
    started = time.monotonic()
    job = engine.submit(req)
    turn = Turn(0.0, len(ids), 0, {})
    async for event in job.events():
        if isinstance(event, FirstToken):
            turn = Turn(event.at - started, len(ids), event.reused_tokens, dict(event.tiers))
        elif isinstance(event, Finished):
            break
    return turn


@dataclass
class Agent:
    """One agent loop's state: its session and its prompt so far."""

    session: str
    ids: list[int]
    reusable: int = 0  # the previous turn's prompt tokens, which the store holds unless it let them go


@dataclass
class Chat:
    """One user's chat: its conversation so far (a new one past chat_max)."""

    index: int
    conversation: int = 0
    ids: list[int] = field(default_factory=list)


async def agent_turn(engine: EmbeddedEngine, w: Workload, a: Agent, hold_s: float, last: bool) -> Turn:
    """One agent turn; every turn but the last ends in a tool call (retained for `hold_s` when > 0)."""
    turn = await one_turn(engine, a.ids, w.answer_tokens, a.session)
    turn.reusable = a.reusable
    if hold_s > 0 and not last:  # what the serving layer does when an answer ends in tool calls
        await asyncio.to_thread(engine.retain, NAMESPACE, a.session, hold_s)
    return turn


async def chat_turns(engine: EmbeddedEngine, lm: LoadedModel, w: Workload, c: Chat, salt: int) -> list[Turn]:
    """`chat_turns` turns of one chat, back to back."""
    turns = []
    for _ in range(w.chat_turns):
        if not c.ids or len(c.ids) + w.chat_tokens > w.chat_max:
            c.conversation += 1
            c.ids = prompt_ids(lm, w.chat_tokens, salt + 50_000 + 100 * c.index + c.conversation)
        else:
            c.ids = c.ids + prompt_ids(lm, w.chat_tokens, salt + 70_000 + 1000 * c.index + len(c.ids))
        turns.append(
            await one_turn(engine, c.ids, w.answer_tokens, f"chat-{salt}-{c.index}-{c.conversation}")
        )
    return turns


async def run_variant(
    engine: EmbeddedEngine, lm: LoadedModel, w: Workload, salt: int, hold_s: float
) -> Result:
    """Rounds of: every agent's turn at once, then the tools' pause, in which every chat takes its turns;
    then the agents come back with their tools' results."""
    result = Result()
    agents = [
        Agent(
            f"agent-{salt}-{i}",
            prompt_ids(lm, w.system_tokens, salt + i) + prompt_ids(lm, 64, salt + 100 + i),
        )
        for i in range(w.agents)
    ]
    chats = [Chat(j) for j in range(w.chats)]
    for t in range(w.turns):
        last = t == w.turns - 1
        turns = await asyncio.gather(*(agent_turn(engine, w, a, hold_s, last) for a in agents))
        if t:
            result.agent[t] = list(turns)
        if last:
            break
        pause = asyncio.gather(asyncio.sleep(w.pause_s), *(chat_turns(engine, lm, w, c, salt) for c in chats))
        for chat in (await pause)[1:]:
            result.chat.extend(chat)
        for i, a in enumerate(agents):  # the tools' results
            a.reusable = len(a.ids)
            a.ids = a.ids + prompt_ids(lm, w.tool_tokens, salt + 1000 * (t + 1) + i)
    return result


def open_engine(lm: LoadedModel, path: Path, l0: int, l2: int, running: int) -> EmbeddedEngine:
    """A fresh store (L0 only in memory, L2 read from the disk, or none) and an engine over it."""
    store = KVStore(
        StoreConfig(l0, 0, l2, path, device=lm.device, drop_page_cache=True), lm.layout, lm.fingerprint
    )
    return EmbeddedEngine(
        {MODEL: lm}, {MODEL: store}, config=engine_config(max_running=running, min_free_memory_bytes=0)
    ).start()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def report(w: Workload, results: dict[str, list[Result]], l0: int, l2: int, demand: int, reps: int) -> None:
    l2_text = (
        f"L2 {l2 / MB:.0f} MB on disk (page cache dropped)" if l2 else "no L2 (what leaves L0 is recomputed)"
    )
    print(
        f"\n{w.agents} agents x {w.turns} turns (tool results {w.tool_tokens} tokens, system prompt "
        f"{w.system_tokens}; while their tools run, at least {w.pause_s:g} s, each of {w.chats} chats takes "
        f"{w.chat_turns} turns of +{w.chat_tokens} tokens, a new conversation past {w.chat_max}); L0 "
        f"{l0 / MB:.0f} MB ({l0 / demand:.0%} of the agents' working set and the chats' longest histories, "
        f"{demand / MB:.0f} MB), L1 0, {l2_text}; {reps} interleaved repetition(s)"
    )
    summary: dict[str, dict[str, float]] = {}
    print(
        "\n| variant | agent turns after a pause | cached share | from L0 | agent TTFT p50 s | p90 s "
        "| chat turns | chat TTFT p50 s | p90 s | holds broken |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in VARIANTS:
        agent_turns = [t for r in results[name] for turns in r.agent.values() for t in turns]
        chat_turns = [t for r in results[name] for t in r.chat]
        a_ttft = [t.ttft_s for t in agent_turns]
        c_ttft = [t.ttft_s for t in chat_turns]
        s = summary[name] = {
            "cached": statistics.fmean(t.reused / t.prompt for t in agent_turns)
            if agent_turns
            else float("nan"),
            "fastest": sum(t.fastest for t in agent_turns) / len(agent_turns)
            if agent_turns
            else float("nan"),
            "a50": percentile(a_ttft, 0.5),
            "a90": percentile(a_ttft, 0.9),
            "c50": percentile(c_ttft, 0.5),
            "c90": percentile(c_ttft, 0.9),
        }
        broken = sum(r.retention_evictions for r in results[name])
        print(
            f"| {name} | {len(agent_turns)} | {s['cached']:.0%} | {s['fastest']:.0%} | {s['a50']:.3f} | "
            f"{s['a90']:.3f} | {len(chat_turns)} | {s['c50']:.3f} | {s['c90']:.3f} | {broken} |"
        )
    print("\nper agent turn (after the tool pause before it): cached share / from L0")
    print("| turn | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS))
    for t in range(1, w.turns):
        cells = []
        for name in VARIANTS:
            turns = [x for r in results[name] for x in r.agent.get(t, [])]
            share = statistics.fmean(x.reused / x.prompt for x in turns) if turns else float("nan")
            fastest = sum(x.fastest for x in turns) / len(turns) if turns else float("nan")
            cells.append(f"{share:.0%} / {fastest:.0%}")
        print(f"| {t} | " + " | ".join(cells) + " |")
    on, off = summary["retention"], summary["lru"]
    agent_p50, chat_p50 = ratio(on["a50"], off["a50"]), ratio(on["c50"], off["c50"])
    print(
        f"\nretention / LRU: agent TTFT p50 {agent_p50:.2f}x, p90 {ratio(on['a90'], off['a90']):.2f}x; "
        f"chat TTFT p50 {chat_p50:.2f}x, p90 {ratio(on['c90'], off['c90']):.2f}x"
    )
    print(
        f"goals: from L0 with retention >= {GOAL_FASTEST:.0%}: {on['fastest']:.0%} "
        f"({'met' if on['fastest'] >= GOAL_FASTEST else 'not met'}); agent TTFT p50 <= {GOAL_AGENT_TTFT}x: "
        f"{agent_p50:.2f}x ({'met' if agent_p50 <= GOAL_AGENT_TTFT else 'not met'}); chat TTFT p50 <= "
        f"{GOAL_CHAT_TTFT}x: {chat_p50:.2f}x ({'met' if chat_p50 <= GOAL_CHAT_TTFT else 'not met'})"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.agents", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run: 2 agents x 4 turns, 3 chats, 1 rep")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--chat-turns", type=int, default=2, help="turns each chat takes while the tools run")
    p.add_argument("--pause", type=float, default=2.0, help="seconds a tool runs at least")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument("--tool-tokens", type=int, default=300)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--chat-tokens", type=int, default=250)
    p.add_argument("--chat-max", type=int, default=3000)
    p.add_argument(
        "--fit",
        type=float,
        default=0.7,
        help="L0: this share of the agents' working set plus the chats' longest histories",
    )
    p.add_argument("--l2-mb", type=int, default=16384, help="L2 on disk; 0: none")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cache-dir", default="./var/models")
    args = p.parse_args(argv)
    if args.quick:
        args.agents, args.chats, args.turns, args.reps = 2, 3, 4, 1
        args.system_tokens, args.tool_tokens, args.chat_tokens, args.chat_max = 300, 200, 250, 1500
    w = Workload(
        args.agents,
        args.chats,
        args.turns,
        args.pause,
        args.system_tokens,
        args.tool_tokens,
        args.answer_tokens,
        args.chat_tokens,
        args.chat_max,
        args.chat_turns,
    )
    policy = RetentionPolicy.from_settings(Settings())
    assert policy is not None  # the defaults retain
    hold_s = policy.seconds(None, ended_in_tool_calls=True)
    lm = load_model(MODEL, DEFAULT_MODEL_SOURCE, dtype=args.dtype, cache_dir=args.cache_dir)
    print(
        f"model {MODEL} on {lm.device} as {str(lm.dtype).removeprefix('torch.')}, {torch.get_num_threads()} "
        f"threads; retention holds {hold_s:g} s after a tool call"
    )
    demand = (w.agents * w.agent_history() + w.chat_pins()) * lm.layout.bytes_per_token
    l0, l2 = int(args.fit * demand), args.l2_mb * MB
    results: dict[str, list[Result]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS))
            for j, name in enumerate(order):
                engine = open_engine(lm, Path(tmp) / f"{name}-{rep}", l0, l2, w.agents + w.chats)
                try:
                    asyncio.run(one_turn(engine, prompt_ids(lm, 64, 7), 2, "warm"))
                    salt = 100_000 * (2 * rep + j + 1)
                    result = asyncio.run(
                        run_variant(engine, lm, w, salt, hold_s if name == "retention" else 0)
                    )
                    result.retention_evictions = engine.stores[MODEL].stats().retention_evictions
                    results[name].append(result)
                finally:
                    engine.close()
    report(w, results, l0, l2, demand, args.reps)


if __name__ == "__main__":
    main()
