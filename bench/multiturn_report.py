"""What a multi-turn run measured, summed up: per-turn records, summaries by history bucket, table, JSON, plot.

Comparisons are paired: a reuse turn is set against the recompute turn of the same conversation and
turn index (same history length, since greedy answers are identical), and the reduction of a bucket is
1 - sum(TTFT with reuse) / sum(TTFT recomputing) over its pairs, so long turns weigh what they cost.
The ideal is set against the server's own TTFT (the X-AttentionStore-TTFT-Ms header: request received
-> first token ready), which excludes HTTP and client overhead that the ideal does not have either.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

BUCKETS: tuple[tuple[str, int, float], ...] = (
    ("<500", 0, 500),
    ("500-1000", 500, 1000),
    ("1000-2000", 1000, 2000),
    (">=2000", 2000, math.inf),
)
IDEAL_SLACK = 1.2  # the target: every hit within 1.2x of the ideal
PAPER_BEST_REDUCTION = 0.87  # AttentionStore (ATC'24): multi-turn TTFT down by up to 87%


@dataclass
class TurnRecord:
    """One request of the run, as the client and the server's headers saw it."""

    mode: str  # "reuse" | "recompute" | "target"
    conversation: str  # ShareGPT id
    slot: int  # position of the conversation in the selection
    turn: int  # 0-based user turn
    round: int  # the round (turn-by-turn interleaving step) it ran in
    history_tokens: int  # prompt tokens of this turn (the whole history plus the new user message)
    reused_tokens: int
    new_tokens: int  # history_tokens - reused_tokens: what the server had to prefill
    hit: str  # X-AttentionStore-Cache, or "n/a" when the target does not send it
    ttft_client_ms: float
    ttft_header_ms: float | None
    total_ms: float
    completion_tokens: int
    reuse_ratio: float | None  # reused / (previous prompt + previous answer); None on turn 0
    ideal_ms: float | None = None  # prefill of the new tokens on an in-memory cache, same model
    raw_read_ms: float | None = None  # plain read of the KV bytes that came from L2
    l2_chunks: int | None = None  # chunks found in L2 during this turn (store stats; rounds of one)
    tiers: dict[str, int] | None = None  # reused tokens per tier (X-AttentionStore-Tiers)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported


def bucket_of(tokens: int) -> str:
    for name, lo, hi in BUCKETS:
        if lo <= tokens < hi:
            return name
    return BUCKETS[-1][0]


def _median(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def _mean(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.fmean(xs) if xs else None


def from_l2(r: TurnRecord) -> bool:
    return r.hit == "l2_hit" or bool(r.l2_chunks)


def ideal_bound_ms(r: TurnRecord) -> float | None:
    """The limit for this hit: ideal prefill, plus the raw read of its L2 bytes when some came from disk."""
    if r.ideal_ms is None:
        return None
    return r.ideal_ms + ((r.raw_read_ms or 0.0) if from_l2(r) else 0.0)


def is_hit(r: TurnRecord) -> bool:
    return r.hit.endswith("_hit") and r.reused_tokens > 0


def _reduction(pairs: Sequence[tuple[TurnRecord, TurnRecord]], attr: str) -> float | None:
    base = [getattr(b, attr) for _, b in pairs]
    reuse = [getattr(a, attr) for a, _ in pairs]
    if not pairs or any(v is None for v in base + reuse) or sum(base) <= 0:
        return None
    return 1.0 - sum(reuse) / sum(base)


def _group_summary(
    recs: Sequence[TurnRecord], pairs: Sequence[tuple[TurnRecord, TurnRecord]]
) -> dict[str, Any]:
    later = [r for r in recs if r.turn > 0]
    hits = [r for r in recs if is_hit(r)]
    ratios = [
        r.ttft_header_ms / b
        for r in hits
        if r.ttft_header_ms is not None and (b := ideal_bound_ms(r)) is not None and b > 0
    ]
    return {
        "turns": len(recs),
        "later_turns": len(later),
        "later_turn_hit_rate": (sum(is_hit(r) for r in later) / len(later)) if later else None,
        "hit_levels": {h: sum(r.hit == h for r in recs) for h in sorted({r.hit for r in recs})},
        "reuse_ratio_mean": _mean(r.reuse_ratio for r in later if r.reuse_ratio is not None),
        "history_tokens_mean": _mean(r.history_tokens for r in recs),
        "new_tokens_mean": _mean(r.new_tokens for r in recs),
        "ttft_client_ms_median": _median(r.ttft_client_ms for r in recs),
        "ttft_header_ms_median": _median(r.ttft_header_ms for r in recs if r.ttft_header_ms is not None),
        "ideal_ms_median": _median(b for r in hits if (b := ideal_bound_ms(r)) is not None),
        "hits_with_ideal": len(ratios),
        "ttft_over_ideal_median": _median(ratios),
        "ttft_over_ideal_max": max(ratios) if ratios else None,
        "hits_within_slack": (sum(x <= IDEAL_SLACK for x in ratios) / len(ratios)) if ratios else None,
        "pairs": len(pairs),
        "ttft_reduction_client": _reduction(pairs, "ttft_client_ms"),
        "ttft_reduction_header": _reduction(pairs, "ttft_header_ms"),
        "recompute_ttft_client_ms_median": _median(b.ttft_client_ms for _, b in pairs),
        "reuse_ttft_client_ms_median": _median(a.ttft_client_ms for a, _ in pairs),
    }


def _throughput(recs: Sequence[TurnRecord]) -> float | None:
    """Prompt tokens per second of prefill (server TTFT, else the client's)."""
    secs = sum((r.ttft_header_ms if r.ttft_header_ms is not None else r.ttft_client_ms) for r in recs) / 1000
    return sum(r.history_tokens for r in recs) / secs if secs > 0 else None


def summarize(records: Sequence[TurnRecord]) -> dict[str, Any]:
    """Summaries overall and by history bucket, plus the issue's targets and how close the run came."""
    reuse_mode = "reuse" if any(r.mode == "reuse" for r in records) else "target"
    reuse = [r for r in records if r.mode == reuse_mode]
    base = {(r.slot, r.turn): r for r in records if r.mode == "recompute"}
    pairs = [(r, base[(r.slot, r.turn)]) for r in reuse if (r.slot, r.turn) in base]
    by_bucket = {
        name: _group_summary(
            [r for r in reuse if bucket_of(r.history_tokens) == name],
            [p for p in pairs if bucket_of(p[0].history_tokens) == name],
        )
        for name, _, _ in BUCKETS
    }
    overall = _group_summary(reuse, pairs)
    l2_hits = [r for r in reuse if is_hit(r) and from_l2(r)]
    mem_hits = [r for r in reuse if is_hit(r) and not from_l2(r)]

    def within(rs: Sequence[TurnRecord]) -> float | None:
        ok = [
            r.ttft_header_ms <= IDEAL_SLACK * b
            for r in rs
            if r.ttft_header_ms is not None and (b := ideal_bound_ms(r)) is not None
        ]
        return sum(ok) / len(ok) if ok else None

    long = by_bucket[">=2000"]["ttft_reduction_client"]
    return {
        "reuse_mode": reuse_mode,
        "overall": overall,
        "by_bucket": by_bucket,
        "prefill_throughput_tok_s": {
            "reuse": _throughput(reuse),
            "recompute": _throughput([b for _, b in pairs]) if pairs else None,
        },
        "targets": {
            "l0_l1_hits_within_1.2x_ideal": within(mem_hits),
            "l0_l1_hits_measured": len(mem_hits),
            "l2_hits_within_1.2x_ideal_plus_read": within(l2_hits),
            "l2_hits_measured": len(l2_hits),
            "ttft_reduction_ge2000": long,
            "beats_paper_best_ge2000": (long > PAPER_BEST_REDUCTION) if long is not None else None,
            "later_turn_hit_rate": overall["later_turn_hit_rate"],
        },
    }


def report_dict(meta: dict[str, Any], records: Sequence[TurnRecord]) -> dict[str, Any]:
    return {"meta": meta, "summary": summarize(records), "turns": [asdict(r) for r in records]}


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def _fmt(x: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(summary: dict[str, Any]) -> str:
    """The terminal table (Markdown, so the README can show it as is)."""
    head = (
        "| history tokens | turns | later-turn hits | reuse ratio | TTFT recompute ms | TTFT reuse ms "
        "| TTFT reduction | ideal ms | server TTFT / ideal | hits <= 1.2x ideal |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    rows = [(name, summary["by_bucket"][name]) for name, _, _ in BUCKETS] + [("all", summary["overall"])]
    for name, s in rows:
        lines.append(
            f"| {name} | {s['turns']} | {_pct(s['later_turn_hit_rate'])} | {_pct(s['reuse_ratio_mean'])} "
            f"| {_fmt(s['recompute_ttft_client_ms_median'])} | {_fmt(s['reuse_ttft_client_ms_median'])} "
            f"| {_pct(s['ttft_reduction_client'])} | {_fmt(s['ideal_ms_median'])} "
            f"| {_fmt(s['ttft_over_ideal_median'], '.2f', 'x')} | {_pct(s['hits_within_slack'])} |"
        )
    tp = summary["prefill_throughput_tok_s"]
    t = summary["targets"]
    lines += [
        "",
        f"TTFT columns: medians, client-measured, over the turns paired with the recompute run; reduction = "
        f"1 - sum(reuse) / sum(recompute). Effective prefill throughput: reuse {_fmt(tp['reuse'])} tok/s, "
        f"recompute {_fmt(tp['recompute'])} tok/s.",
        f"Targets: L0/L1 hits within 1.2x ideal {_pct(t['l0_l1_hits_within_1.2x_ideal'])} "
        f"(of {t['l0_l1_hits_measured']}); L2 hits within 1.2x ideal+read "
        f"{_pct(t['l2_hits_within_1.2x_ideal_plus_read'])} (of {t['l2_hits_measured']}); "
        f"TTFT reduction >=2000 tokens {_pct(t['ttft_reduction_ge2000'])} (paper: 87%); "
        f"later-turn hit rate {_pct(t['later_turn_hit_rate'])}.",
    ]
    return "\n".join(lines)


def plot(path: Path, records: Sequence[TurnRecord], title: str) -> None:
    """TTFT per turn against history length: reuse, recompute, and the ideal for the reuse turns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reuse_mode = "reuse" if any(r.mode == "reuse" for r in records) else "target"
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    series = [
        ("recompute", [r for r in records if r.mode == "recompute"], "tab:red", "o"),
        (
            reuse_mode + " (miss)",
            [r for r in records if r.mode == reuse_mode and not is_hit(r)],
            "tab:orange",
            "s",
        ),
        (
            reuse_mode + " (L0/L1 hit)",
            [r for r in records if r.mode == reuse_mode and is_hit(r) and not from_l2(r)],
            "tab:blue",
            "^",
        ),
        (
            reuse_mode + " (L2 hit)",
            [r for r in records if r.mode == reuse_mode and is_hit(r) and from_l2(r)],
            "tab:purple",
            "v",
        ),
    ]
    for label, rs, color, marker in series:
        if rs:
            ax.scatter(
                [r.history_tokens for r in rs],
                [r.ttft_client_ms for r in rs],
                c=color,
                marker=marker,
                s=28,
                label=label,
                alpha=0.8,
            )
    ideal = [
        (r.history_tokens, b)
        for r in records
        if r.mode == reuse_mode and (b := ideal_bound_ms(r)) is not None
    ]
    if ideal:
        ax.scatter(
            [x for x, _ in ideal],
            [y for _, y in ideal],
            c="tab:green",
            marker="x",
            s=28,
            label="ideal (new tokens on in-memory KV)",
        )
    ax.set_yscale("log")
    ax.set_xlabel("history (prompt) tokens")
    ax.set_ylabel("TTFT (ms, client-measured; ideal: model only)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def scheduler_table(report: dict[str, Any]) -> str:
    """Scheduler-aware tiering against plain LRU (modes "reuse" and "reuse-lru"): where reused tokens
    came from at admission, TTFT, and what the look-ahead prefetch was worth."""
    rows = [
        "| mode | reused from L0 / L1 / L2 | L2 tokens on the critical path | TTFT p50 / p90 ms (server) | queue wait mean ms | prefetch used / wasted |",
        "|---|---|---|---|---|---|",
    ]
    stats = report.get("meta", {}).get("store_stats", {})
    for mode in ("reuse", "reuse-lru"):
        recs = [r for r in report.get("turns", []) if r["mode"] == mode and r["turn"] > 0]
        if not recs:
            continue
        tiers = {t: sum((r.get("tiers") or {}).get(t, 0) for r in recs) for t in ("l0", "l1", "l2")}
        total = sum(tiers.values()) or 1
        ttft = sorted(r["ttft_header_ms"] for r in recs if r.get("ttft_header_ms") is not None)
        p50 = ttft[len(ttft) // 2] if ttft else float("nan")
        p90 = ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else float("nan")
        st = stats.get(mode, {})
        runner = st.get("runner") or {}
        wait_ms = 1000.0 * runner.get("queue_wait_seconds", 0.0) / max(1, runner.get("admitted", 0))
        rows.append(
            f"| {mode} | {tiers['l0'] / total:.0%} / {tiers['l1'] / total:.0%} / {tiers['l2'] / total:.0%} | "
            f"{tiers['l2']} | {p50:.0f} / {p90:.0f} | {wait_ms:.0f} | "
            f"{st.get('prefetch_used', 0)} / {st.get('prefetch_wasted', 0)} |"
        )
    return "\n".join(rows)
