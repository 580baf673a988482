"""The in-process targets of `attnstore bench`: the proxy with reuse, and the same proxy recomputing.

Both are the real application (`proxy.app.build_full_app`) on 127.0.0.1:<free port>, each in its own
thread and event loop, sharing one loaded model so the comparison runs on identical weights and the
model is loaded once. They differ only in `attention_store.enabled`; everything else comes from the
user's settings file, adjusted so the benchmark cannot disturb a real deployment (a temporary L2 folder
unless one is given, port 0) and the runner takes every concurrent session at once.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import orjson

from proxy.settings import Settings, parse_settings

# The threaded app server is test support (tests/support); `attnstore bench` run from outside the
# checkout's root finds it next to bench/.
if importlib.util.find_spec("tests") is None:
    sys.path.append(str(Path(__file__).resolve().parent.parent))
from tests.support.threaded_server import AppServer  # noqa: E402

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


def derive_settings(base: Settings, spec: TargetSpec, base_dir: Path) -> Settings:
    raw: dict[str, Any] = copy.deepcopy(msgspec.to_builtins(base))
    store = raw["attention_store"]
    store["enabled"] = spec.reuse
    store["tiering"]["l2_disk"]["path"] = str(spec.l2_path)
    if spec.tiers in TIERS_MB:
        store["tiering"]["l0_gpu"]["capacity_mb"] = TIERS_MB[spec.tiers]["l0"]
        store["tiering"]["l1_host"]["capacity_mb"] = TIERS_MB[spec.tiers]["l1"]
    lr = raw["local_runner"]
    lr["enabled"] = True
    lr["max_running"] = spec.max_running or max(lr["max_running"], spec.concurrency)
    lr["l2_drop_page_cache"] = spec.cold_l2
    store["scheduler_aware"]["enabled"] = spec.scheduler_aware
    lr["max_queue"] = max(lr["max_queue"], 2 * spec.concurrency)
    if spec.threads is not None:
        lr["threads"] = spec.threads
    raw["proxy"]["port"] = 0
    raw["proxy"]["api_keys"] = []
    raw["proxy"]["max_concurrent_per_client"] = 0  # one bench client plays many users
    raw["proxy"]["log_level"] = "warning"
    return parse_settings(orjson.dumps(raw), base_dir, env={})


class InProcessTarget:
    """One proxy started in a background thread; `url` is its chat endpoint, `base` its root."""

    def __init__(self, settings: Settings, models: Mapping[str, Any], base_dir: Path) -> None:
        from proxy.app import build_full_app

        self.settings = settings
        self._server = AppServer(build_full_app(settings, models=models, base_dir=base_dir))

    def start(self) -> InProcessTarget:
        self._server.start()
        return self

    @property
    def base(self) -> str:
        return self._server.url

    @property
    def url(self) -> str:
        return self._server.url + "/v1/chat/completions"

    def stop(self) -> None:
        self._server.stop(timeout=120)
