"""The servers of `attnstore bench`: the proxy with reuse and the same proxy recomputing (in process),
or one already running (--target), and the peers (--peer) it is compared with.

Both are the real application (`proxy.http.app.build_full_app`) on 127.0.0.1:<free port>, each in its own
thread and event loop, sharing one loaded model so the comparison runs on identical weights and the
model is loaded once. They differ only in `attention_store.enabled`; everything else comes from the
user's settings file, adjusted so the benchmark cannot disturb a real deployment (a temporary L2 folder
unless one is given, port 0) and the runner takes every concurrent session at once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import orjson
import urllib3

from proxy.settings import Settings, parse_settings

from .multiturn_options import BenchOptions
from .support.threaded_server import AppServer
from .support.waiting import wait_until

# A 256-token chunk of SmolLM2's float32 KV is ~11.8 MB: these hold two and four chunks, so a
# 2,000-token history spills to L2 and later turns read from all three tiers.
SMALL_TIERS_MB = {"l0": 24.0, "l1": 48.0}
# No memory tiers at all: every reused chunk is read back from its L2 file (the disk path, measured alone).
TIERS_MB = {"small": SMALL_TIERS_MB, "disk": {"l0": 0.0, "l1": 0.0}}


@dataclass(frozen=True)
class TargetSpec:
    """How one in-process proxy differs from the user's settings."""

    reuse: bool
    l2_path: Path
    concurrency: int
    tiers: str = "default"  # "default" | "small" | "disk"
    threads: int | None = None
    max_running: int = 0  # 0: concurrency
    scheduler_aware: bool = True
    cold_l2: bool = False
    fast_memory_mb: float | None = None  # L0 + L1, half each (a peer's KV memory, matched)
    dtype: str | None = None  # local_runner.dtype; None: the user's settings


def derive_settings(base: Settings, spec: TargetSpec, base_dir: Path) -> Settings:
    raw: dict[str, Any] = copy.deepcopy(msgspec.to_builtins(base))
    store = raw["attention_store"]
    store["enabled"] = spec.reuse
    store["tiering"]["l2_disk"]["path"] = str(spec.l2_path)
    if spec.tiers in TIERS_MB:
        store["tiering"]["l0_gpu"]["capacity_mb"] = TIERS_MB[spec.tiers]["l0"]
        store["tiering"]["l1_host"]["capacity_mb"] = TIERS_MB[spec.tiers]["l1"]
    if spec.fast_memory_mb is not None:
        store["tiering"]["l0_gpu"]["capacity_mb"] = spec.fast_memory_mb / 2
        store["tiering"]["l1_host"]["capacity_mb"] = spec.fast_memory_mb / 2
    lr = raw["local_runner"]
    lr["enabled"] = True
    lr["max_running"] = spec.max_running or max(lr["max_running"], spec.concurrency)
    lr["l2_drop_page_cache"] = spec.cold_l2
    store["scheduler_aware"]["enabled"] = spec.scheduler_aware
    lr["max_queue"] = max(lr["max_queue"], 2 * spec.concurrency)
    if spec.threads is not None:
        lr["threads"] = spec.threads
    if spec.dtype is not None:
        lr["dtype"] = spec.dtype
    raw["proxy"]["port"] = 0
    raw["proxy"]["api_keys"] = []
    raw["proxy"]["log_level"] = "warning"
    return parse_settings(orjson.dumps(raw), base_dir, env={})


class InProcessTarget:
    """One proxy started in a background thread; `url` is its chat endpoint, `base` its root."""

    def __init__(self, settings: Settings, models: Mapping[str, Any], base_dir: Path) -> None:
        from proxy.http.app import build_full_app

        self.settings = settings
        self._server = AppServer(build_full_app(settings, models=models, base_dir=base_dir))

    def start(self, compile_timeout_s: float = 900) -> InProcessTarget:
        """Start it and wait until its runner has compiled its step (the first turns would otherwise
        wait for the compile, and the comparison would count it)."""
        self._server.start()
        wait_until(self._warm, "the local runner's compile", compile_timeout_s, interval=0.5)
        return self

    def _warm(self) -> bool:
        doc = orjson.loads(urllib3.request("GET", self.base + "/healthz", timeout=5).data)
        if doc.get("status") != "ok":  # local serving still starting
            return False
        local = doc.get("local") or {}
        return not any(str(m.get("compiled", "")).startswith("compiling") for m in local.values())

    @property
    def base(self) -> str:
        return self._server.url

    @property
    def url(self) -> str:
        return self._server.url + "/v1/chat/completions"

    def stop(self) -> None:
        self._server.stop(timeout=120)


@dataclass(frozen=True)
class Target:
    """One server the bench sends turns to, under its label."""

    mode: str  # label: "reuse" / "recompute" / "reuse-lru", "attnstore", "target", or a peer's
    url: str  # chat endpoint
    base: str  # server root (for /v1/attention_store/stats)
    model: str | None = None  # model name to request there (None: the bench's --model)
    pgids: tuple[int, ...] = ()  # its process groups, stopped while the other servers' waves run


def target_at(label: str, url: str, model: str | None = None) -> Target:
    """A running server from its base URL (with or without /v1, or the chat endpoint itself)."""
    root = url.rstrip("/").removesuffix("/chat/completions").removesuffix("/v1")
    return Target(label, root + "/v1/chat/completions", root, model)


def peer_targets(options: BenchOptions, taken: set[str]) -> list[Target]:
    """--peer URLs with their --peer-label (default peer1, peer2...) and --peer-model, labels unique."""
    out: list[Target] = []
    for i, url in enumerate(options.peer):
        label = options.peer_label[i] if i < len(options.peer_label) else f"peer{i + 1}"
        while label in taken:
            label += "'"
        taken.add(label)
        model = options.peer_model[i] if i < len(options.peer_model) else None
        pgids = tuple(int(p) for p in options.peer_pgid[i].split(",")) if i < len(options.peer_pgid) else ()
        out.append(replace(target_at(label, url, model), pgids=pgids))
    return out


@dataclass
class Started:
    models: Mapping[str, Any]
    targets: list[Target]
    l2_dir: Path | None  # the in-process reuse proxy's L2 folder (None with --target)
    chunk_tokens: int


def start_targets(
    options: BenchOptions,
    base: Settings,
    base_dir: Path,
    stack: contextlib.ExitStack,
    models: Mapping[str, Any] | None,
    reuse_label: str = "reuse",
) -> Started:
    """Load the model (unless given), start the in-process proxies (stopped by `stack`) or take
    --target, then the peers. The recompute baseline runs only when there is no peer to compare with."""
    from proxy.local.build import load_models

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
        fast_memory_mb=options.fast_memory_mb,
        dtype=options.dtype,
    )
    reuse_settings = derive_settings(base, spec, base_dir)
    if models is None:
        models = load_models(reuse_settings, base_dir)
    elif options.threads:
        import torch

        torch.set_num_threads(options.threads)
    targets: list[Target] = []
    if options.target:
        targets.append(target_at("target", options.target))
    else:
        specs = [(reuse_label, reuse_settings)]
        if options.compare_lru:
            lru = dataclasses.replace(spec, l2_path=l2_dir / "lru", scheduler_aware=False)
            specs.append(("reuse-lru", derive_settings(base, lru, base_dir)))
        if options.baseline and not options.peer:
            no_reuse = dataclasses.replace(spec, reuse=False, l2_path=l2_dir / "unused")
            specs.append(("recompute", derive_settings(base, no_reuse, base_dir)))
        for mode, settings in specs:
            server = InProcessTarget(settings, models, base_dir).start()
            stack.callback(server.stop)
            targets.append(Target(mode, server.url, server.base))
    targets += peer_targets(options, {t.mode for t in targets})
    l2 = None if options.target else l2_dir
    return Started(models, targets, l2, base.local_runner.kv_chunk_tokens)
