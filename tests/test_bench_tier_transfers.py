"""bench.tier_transfers' choice of moves (`--tiers`, `--no-puts`): a comparison of one tier's moves
between two versions measures those alone, without the other tiers' allocations before them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def transfers(*args: str) -> str:
    cmd = [sys.executable, "-m", "bench.tier_transfers", "--tokens", "512", "--reps", "1", "--layout", "135m"]
    done = subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def test_l2_alone_measures_only_l2s_moves() -> None:
    out = transfers("--tiers", "l2", "--no-puts")
    assert "l2 -> pages warm GB/s" in out and "l2 -> pages cold GB/s" in out and "pages -> l2 GB/s" in out
    assert "l1" not in out and "l0" not in out and "put returns" not in out


def test_every_move_by_default() -> None:
    out = transfers()
    for row in ("l0 -> pages", "l1 -> pages", "pages -> l1", "l2 -> pages warm", "put returns (L2 full"):
        assert row in out, row


def test_an_unknown_tier_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.tier_transfers", "--tiers", "l3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--tiers takes l0, l1, l2" in done.stderr
