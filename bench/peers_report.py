"""The side-by-side run summed up per server: TTFT of later turns, the share of prompt tokens served from
cache, wall time, errors; a Markdown table and a plot with one line per server.

Later turns only (turn >= 1): turn 0 has no history to reuse on any server, so it says nothing about
caching and would dilute the difference. TTFT is the client's (request sent -> first content token), the
one measure every server has. `cached_share` = cached prompt tokens / prompt tokens over the later turns
whose answer reported `usage.prompt_tokens_details.cached_tokens`; None when the server never did.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .multiturn_report import TurnRecord


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks, as numpy's default; None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _server_summary(recs: Sequence[TurnRecord], errors: int, wall_s: float) -> dict[str, Any]:
    later = [r for r in recs if r.turn > 0]
    ttft = [r.ttft_client_ms / 1000.0 for r in later]
    first = [r.ttft_client_ms / 1000.0 for r in recs if r.turn == 0]
    reported = [r for r in later if r.cached_tokens is not None]
    prompt = sum(r.history_tokens for r in reported)
    return {
        "turns": len(recs),
        "later_turns": len(later),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "first_turn_ttft_p50_s": percentile(first, 50),
        "cached_share": (sum(r.cached_tokens or 0 for r in reported) / prompt) if prompt else None,
        "cached_reported_turns": len(reported),
        "later_prompt_tokens": sum(r.history_tokens for r in later),
        "later_prompt_tokens_mean": statistics.fmean(r.history_tokens for r in later) if later else None,
        "hit_levels": {h: sum(r.hit == h for r in later) for h in sorted({r.hit for r in later})},
        "wall_s": wall_s,
        "errors": errors,
    }


def summarize_servers(
    records: Sequence[TurnRecord],
    errors: Sequence[dict[str, Any]],
    wall_s: dict[str, float],
    labels: Sequence[str],
) -> dict[str, dict[str, Any]]:
    """Per server label (in the order given): its summary."""
    return {
        label: _server_summary(
            [r for r in records if r.mode == label],
            sum(e["server"] == label for e in errors),
            wall_s.get(label, 0.0),
        )
        for label in labels
    }


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _pct(x: float | None) -> str:
    return "not reported" if x is None else f"{100 * x:.0f}%"


def servers_table(report: dict[str, Any]) -> str:
    """Markdown, as README shows it; one row per server."""
    w = report["meta"].get("workload", {})
    lines = [
        "| server | later turns | prompt tokens from cache | TTFT p50 | TTFT p90 | TTFT mean | first turns p50 "
        "| wall | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, s in report["servers"].items():
        lines.append(
            f"| {label} | {s['later_turns']} | {_pct(s['cached_share'])} | {_s(s['ttft_p50_s'])} "
            f"| {_s(s['ttft_p90_s'])} | {_s(s['ttft_mean_s'])} | {_s(s['first_turn_ttft_p50_s'])} "
            f"| {s['wall_s']:.0f} s | {s['errors']} |"
        )
    lines += [
        "",
        f"{w.get('sessions')} conversations x {w.get('turns')} turns, {w.get('concurrency')} at a time, "
        "least recently served next; TTFT client-measured over later turns; cache share from "
        "usage.prompt_tokens_details.cached_tokens; wall = the server's own waves, summed.",
    ]
    return "\n".join(lines)


def _by_turn(recs: Sequence[TurnRecord], value: Any) -> tuple[list[int], list[float]]:
    turns = sorted({r.turn for r in recs})
    xs, ys = [], []
    for t in turns:
        vals = [v for r in recs if r.turn == t and (v := value(r)) is not None]
        if vals:
            xs.append(t)
            ys.append(statistics.median(vals))
    return xs, ys


def _share(r: TurnRecord) -> float | None:
    if r.cached_tokens is None or r.history_tokens <= 0:
        return None
    return r.cached_tokens / r.history_tokens


def plot_servers(path: Path, records: Sequence[TurnRecord], labels: Sequence[str], title: str) -> None:
    """Two panels, one line per server: median TTFT by turn, and median share of the prompt from cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_ax, share_ax) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
    for label in labels:
        recs = [r for r in records if r.mode == label]
        xs, ys = _by_turn(recs, lambda r: r.ttft_client_ms / 1000.0)
        if xs:
            ttft_ax.plot(xs, ys, marker="o", label=label)
        xs, ys = _by_turn(recs, _share)
        if xs:
            share_ax.plot(xs, [100 * y for y in ys], marker="o", label=label)
    ttft_ax.set_ylim(bottom=0)
    ttft_ax.set_xlabel("turn")
    ttft_ax.set_ylabel("TTFT, median (s, client-measured)")
    share_ax.set_xlabel("turn")
    share_ax.set_ylabel("prompt tokens from cache, median (%)")
    share_ax.set_ylim(-2, 102)
    for ax in (ttft_ax, share_ax):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
