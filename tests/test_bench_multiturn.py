"""The multi-turn benchmark: ShareGPT loading and selection, the statistics, and one tiny end-to-end run
(2 conversations x 2 turns, short messages, 8-token answers) so `attnstore bench` cannot rot.
Timings are never asserted; the fields and the accounting are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import sharegpt
from bench.multiturn import BenchOptions, main, parser, run_bench
from bench.multiturn_report import TurnRecord, bucket_of, summarize, table

RECORD_FIELDS = {
    "mode",
    "conversation",
    "slot",
    "turn",
    "round",
    "history_tokens",
    "reused_tokens",
    "new_tokens",
    "hit",
    "ttft_client_ms",
    "ttft_header_ms",
    "total_ms",
    "completion_tokens",
    "reuse_ratio",
    "ideal_ms",
    "raw_read_ms",
    "l2_chunks",
    "tiers",
    "cached_tokens",
}


def _conv(i: int, turns: int) -> dict:
    msgs = []
    for t in range(turns):
        msgs += [{"from": "human", "value": f"question {i}.{t}"}, {"from": "gpt", "value": "answer"}]
    return {"id": f"c{i}", "conversations": msgs}


def test_truncated_array_keeps_complete_objects(tmp_path: Path):
    text = json.dumps([_conv(i, 1 + i % 4) for i in range(9)], indent=1)
    cut = text[: text.rindex('"id": "c8"') + 5]  # cut inside the last object, as the wheel's file is
    path = tmp_path / "sg.json"
    path.write_text(cut)
    convs = list(sharegpt.iter_json_array(path, read_bytes=37))  # tiny reads: objects span many
    assert [c["id"] for c in convs] == [f"c{i}" for i in range(8)]
    kept = sharegpt.load_conversations(path, min_turns=3)
    assert [c.id for c in kept] == ["c2", "c3", "c6", "c7"]
    assert kept[0].user_messages == ("question 2.0", "question 2.1", "question 2.2")
    a, b = sharegpt.select(kept, 2, seed=5), sharegpt.select(kept, 2, seed=5)
    assert a == b and len(a) == 2


def test_empty_human_turns_and_non_conversations_are_dropped():
    conv = sharegpt.to_conversation(
        {"id": "x", "conversations": [{"from": "human", "value": " "}, {"from": "human", "value": "hi"}]}
    )
    assert conv is not None and conv.user_messages == ("hi",)
    assert sharegpt.to_conversation([1, 2]) is None


def test_summary_pairs_buckets_and_targets():
    def rec(mode, turn, hist, reused, hit, ttft, ideal=None):
        return TurnRecord(
            mode,
            "c",
            0,
            turn,
            turn,
            hist,
            reused,
            hist - reused,
            hit,
            ttft,
            ttft,
            ttft + 5,
            8,
            reused / hist if turn else None,
            ideal,
        )

    records = [
        rec("reuse", 0, 300, 0, "miss", 100.0, 95.0),
        rec("recompute", 0, 300, 0, "miss", 100.0),
        rec("reuse", 1, 2100, 2000, "l0_hit", 60.0, 55.0),
        rec("recompute", 1, 2100, 0, "miss", 1000.0),
    ]
    s = summarize(records)
    assert bucket_of(499) == "<500" and bucket_of(2000) == ">=2000"
    assert s["by_bucket"][">=2000"]["ttft_reduction_client"] == pytest.approx(0.94)
    assert s["by_bucket"]["<500"]["ttft_reduction_client"] == pytest.approx(0.0)
    assert s["overall"]["later_turn_hit_rate"] == 1.0
    assert s["targets"]["l0_l1_hits_within_1.2x_ideal"] == 1.0
    assert s["targets"]["beats_paper_best_ge2000"] is True
    assert ">=2000" in table(s)


def test_cli_options_parse():
    args = parser().parse_args(
        ["--concurrency", "4", "--tiers", "small", "--no-ideal", "--target", "http://x"]
    )
    assert args.concurrency == 4 and args.tiers == "small" and not args.ideal and args.target == "http://x"
    assert main(["--concurrency", "0"]) == 2


@pytest.mark.model
def test_bench_end_to_end(smollm, tmp_path: Path):
    settings = tmp_path / "settings.json"
    settings.write_text('{"local_runner": {"compile": false}}')  # a compile per proxy: a minute each
    options = BenchOptions(
        settings=str(settings),
        conversations=2,
        min_turns=2,
        max_turns=2,
        max_message_tokens=24,
        max_tokens=8,
        seed=1,
        threads=1,
        out_dir=str(tmp_path),
        name="e2e",
        progress=False,
    )
    report = run_bench(options, models={smollm.name: smollm})
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert (tmp_path / "e2e.png").stat().st_size > 0
    turns = data["turns"]
    assert len(turns) == 2 * 2 * 2  # conversations x turns x (reuse, recompute)
    for t in turns:
        assert set(t) == RECORD_FIELDS
        assert t["new_tokens"] == t["history_tokens"] - t["reused_tokens"]
        assert t["ttft_client_ms"] > 0 and t["total_ms"] >= t["ttft_client_ms"]
        assert t["hit"] in ("l0_hit", "l1_hit", "l2_hit", "miss")
        assert sum(t["tiers"].values()) == t["reused_tokens"]  # the Tiers header adds up
        assert t["cached_tokens"] == t["reused_tokens"]  # usage reports what the headers say
    base = [t for t in turns if t["mode"] == "recompute"]
    reuse = [t for t in turns if t["mode"] == "reuse"]
    assert all(t["reused_tokens"] == 0 and t["hit"] == "miss" for t in base)
    assert all(t["ideal_ms"] is not None for t in reuse)
    assert {t["turn"] for t in reuse} == {0, 1}
    later = [t for t in reuse if t["turn"] == 1]
    assert all(t["reuse_ratio"] is not None for t in later)
    summary = data["summary"]
    assert set(summary["by_bucket"]) == {"<500", "500-1000", "1000-2000", ">=2000"}
    assert summary["overall"]["pairs"] == 4
    assert {"reuse", "recompute"} == set(summary["prefill_throughput_tok_s"])
    assert data["meta"]["model"] == smollm.name and len(data["meta"]["conversations"]) == 2
    assert report["summary"] == summary
