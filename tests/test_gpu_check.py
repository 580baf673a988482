"""The GPU check's script (bench/gpu/run_check.sh, `make gpu-check`) run end to end on this CPU, small.

A device session is short and rare (minutes, drawn by chance); a script that broke since it last ran
would spend it. This dry run goes through every phase but the CUDA tests: random-weight models built in
code, each phase's server started, driven, summarized and stopped, the tiers' benchmark, and BUDGET_S
cutting a phase short. Exactness holds here (the CPU's default path is batch-invariant), so its figures
are asserted too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

pytestmark = pytest.mark.model  # builds and serves models of its own: a minute and more

ROOT = Path(__file__).resolve().parent.parent
SMALL = {
    "MODELS": "m135",
    "MODEL_DEVICE": "cpu",
    "DEVICE": "cpu",
    "PERF_MODEL": "m135",
    "LENGTHS": "300",
    "EXACT_LENGTHS": "300",
    "STREAMS": "1,2",
    "DECODE": "4",
    "CONVS": "2",
    "WORDS": "60",
    "TIER_TOKENS": "512",
    "TIER_LAYOUT": "135m",
    "KERNEL_SHAPE": "tiny",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_check(out: Path, models: Path, port: int, **env: str) -> str:
    full = {**os.environ, **SMALL, "PY": sys.executable, "MODELS_DIR": str(models), "PORT": str(port), **env}
    subprocess.run(
        ["bash", "bench/gpu/run_check.sh", str(out)],
        cwd=ROOT,
        env=full,
        timeout=600,
        check=True,
        capture_output=True,
    )
    return (out / "log.txt").read_text()


def summaries(path: Path) -> dict[str, dict]:
    rows = [orjson.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if r.get("step", "").startswith("summary")}


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_every_phase_runs_and_reports(tmp_path: Path) -> None:
    port = free_port()
    log = run_check(
        tmp_path / "out", tmp_path / "models", port, PHASES="models perf correct tiers kernels exact"
    )
    out = tmp_path / "out"
    assert "m135: 0.13 B parameters" in log
    for name in ("correct.jsonl", "exact-correct.jsonl"):  # reuse == recompute, batched == alone
        found = summaries(out / name)
        assert found["summary-reuse"]["equal"] == found["summary-reuse"]["of"] == 2, found
        assert found["summary-batch"]["equal"] == found["summary-batch"]["of"] == 8, found
    for name in ("perf.jsonl", "exact-perf.jsonl"):
        rows = [orjson.loads(line) for line in (out / name).read_text().splitlines() if line.strip()]
        streams = [r for r in rows if r.get("step") == "streams"]
        assert [r["n"] for r in streams] == [1, 2] and all(r["failed"] == 0 for r in streams), streams
    assert log.count("warmed up after") == 4, log  # each server waited for before it was timed
    assert "ratio" in log and "equal True" in log  # the summarized TTFT table: a hit against a recompute
    assert "l1 -> pages GB/s" in log and "put returns" in log
    kernels = [orjson.loads(line) for line in (out / "kernels.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in kernels} == {"prefill", "decode", "linear"}, kernels
    assert not [r for r in kernels if "failed" in r], kernels  # every config launches (here: interpreted)
    assert "SDPA, keys whole" in log and "DIFFERS" not in log, log
    assert "attention: fastest config that ran and agreed everywhere" in log and "of torch's product" in log
    assert "s: done" in log
    assert sorted(p.name for p in out.glob("settings-*.json")) == [
        "settings-correct.json",
        "settings-exact-correct.json",
        "settings-exact-perf.json",
        "settings-perf.json",
    ]
    assert not listening(port), "a server outlived its phase"
    assert not list(Path("/tmp").glob(f"attnstore-kv-{port}-*")), "a phase's L2 was left behind"


def test_the_budget_cuts_and_skips_phases(tmp_path: Path) -> None:
    """Uncut, this correctness phase alone takes well over a minute here; within BUDGET_S=40 it is cut
    short (or skipped) and the kernels' phase, with under 30 s left, is skipped: the run ends near 40 s."""
    port = free_port()
    started = time.monotonic()
    log = run_check(
        tmp_path / "out",
        tmp_path / "models",
        port,
        PHASES="models correct kernels",
        BUDGET_S="40",
        CONVS="6",
        WORDS="3000",
    )
    assert time.monotonic() - started < 40 + 20, log  # + stopping a server; uncut: 80 s and more
    assert "skip kernels: under 30 s of BUDGET_S=40 left" in log
    assert "SDPA, keys whole" not in log
    assert "s: done" in log
    assert not listening(port)


def test_a_server_that_dies_at_start_ends_its_phase_at_once(tmp_path: Path) -> None:
    """No model where the phase's server looks (the models' phase not run): the server exits while
    loading, the check says so with the server's log, and the phase ends in seconds, not at the drive's
    limit (150 s here) polling a server that is gone."""
    port = free_port()
    started = time.monotonic()
    log = run_check(tmp_path / "out", tmp_path / "no-models", port, PHASES="correct")
    assert time.monotonic() - started < 60, log
    assert "died after" in log and "warmed up" not in log, log
    assert "s: done" in log
