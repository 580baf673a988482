"""`attnstore bench --peer`: the many-sessions workload against the attnstore it starts and against other
OpenAI-compatible servers, here a second attnstore (real model, reports cached tokens) and the fake
upstream (reports none). Timings are never asserted; the schedule, the accounting and the JSON are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.multiturn import BenchOptions, main, parser, run_bench
from bench.multiturn_report import TurnRecord
from bench.peers_report import percentile, summarize_servers
from tests.model_fixture import MODEL

SUMMARY_KEYS = {"ttft_p50_s", "ttft_p90_s", "ttft_mean_s", "cached_share", "wall_s", "errors", "later_turns"}


def _rec(mode: str, turn: int, ttft_ms: float, prompt: int, cached: int | None) -> TurnRecord:
    return TurnRecord(mode, "c", 0, turn, turn, prompt, cached or 0, prompt - (cached or 0), "n/a",
                      ttft_ms, None, ttft_ms + 1, 4, None, cached_tokens=cached)  # fmt: skip


def test_summaries_count_later_turns_and_reported_cache_only():
    records = [
        _rec("a", 0, 900.0, 100, 0),  # turn 0: not in the later-turn figures
        _rec("a", 1, 100.0, 200, 150),
        _rec("a", 2, 300.0, 300, 250),
        _rec("b", 1, 500.0, 200, None),  # a server that never reports cached tokens
    ]
    errors = [{"server": "b", "conversation": "c", "turn": 2, "error": "HTTP 500"}]
    s = summarize_servers(records, errors, {"a": 3.0, "b": 1.5}, ["a", "b"])
    assert s["a"]["later_turns"] == 2 and s["a"]["ttft_p50_s"] == pytest.approx(0.2)
    assert s["a"]["ttft_p90_s"] == pytest.approx(0.28)
    assert s["a"]["cached_share"] == pytest.approx(400 / 500)
    assert s["a"]["first_turn_ttft_p50_s"] == pytest.approx(0.9) and s["a"]["errors"] == 0
    assert s["b"]["cached_share"] is None and s["b"]["errors"] == 1 and s["b"]["wall_s"] == 1.5
    assert percentile([], 50) is None and percentile([4.0], 90) == 4.0


def test_cli_options_for_peers():
    args = parser().parse_args(
        ["--peer", "http://a", "--peer-label", "vllm", "--peer", "http://b", "--sessions", "32"]
        + ["--turns", "8", "--fast-memory-mb", "1024", "--dtype", "float32", "--json", "out.json"]
    )
    assert args.peer == ["http://a", "http://b"] and args.peer_label == ["vllm"]
    assert args.sessions == 32 and args.turns == 8 and args.fast_memory_mb == 1024
    assert args.dtype == "float32" and args.json == "out.json"
    assert main(["--peer-label", "x"]) == 2  # a label names a peer


@pytest.mark.model
def test_many_sessions_against_a_second_attnstore_and_the_fake_upstream(
    smollm, local_proxy, fake_upstream, tmp_path: Path
):
    second = local_proxy()
    out = tmp_path / "out.json"
    settings = tmp_path / "settings.json"
    settings.write_text('{"local_runner": {"compile": false}}')  # the bench's own attnstore: no compile
    args = parser().parse_args(
        ["--peer", second.url, "--peer-label", "second", "--peer", fake_upstream.url + "/v1"]
        + ["--peer-label", "fake", "--peer-model", MODEL, "--peer-model", "gpt-fake"]
        + ["--sessions", "3", "--turns", "2", "--concurrency", "2", "--max-message-tokens", "16"]
        + ["--max-tokens", "4", "--seed", "2", "--threads", "1", "--fast-memory-mb", "64"]
        + ["--json", str(out), "--no-progress", "--settings", str(settings)]
    )
    options = BenchOptions(**vars(args))
    report = run_bench(options, models={smollm.name: smollm})
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert list(data["servers"]) == ["attnstore", "second", "fake"]
    for label, s in data["servers"].items():
        assert set(s) >= SUMMARY_KEYS, label
        assert s["errors"] == 0 and s["later_turns"] == 3 and s["wall_s"] > 0
        assert 0 < s["ttft_p50_s"] <= s["ttft_p90_s"]
    # Both attnstores report cached tokens and reuse the history; the fake upstream reports none.
    assert data["servers"]["attnstore"]["cached_share"] > 0.3
    assert data["servers"]["second"]["cached_share"] > 0.3
    assert data["servers"]["fake"]["cached_share"] is None
    # S = 3 conversations, C = 2 at a time, the least recently served next: waves [0, 1], [2, 0], [1, 2].
    for label in data["servers"]:
        turns = {(t["slot"], t["turn"], t["round"]) for t in data["turns"] if t["mode"] == label}
        assert turns == {(0, 0, 0), (1, 0, 0), (2, 0, 1), (0, 1, 1), (1, 1, 2), (2, 1, 2)}, label
    # The full history is resent: a later turn's prompt holds the earlier turn's prompt and answer.
    local = {(t["slot"], t["turn"]): t for t in data["turns"] if t["mode"] == "attnstore"}
    for slot in range(3):
        assert local[(slot, 1)]["history_tokens"] > local[(slot, 0)]["history_tokens"]
        assert local[(slot, 1)]["cached_tokens"] == local[(slot, 1)]["reused_tokens"] > 0
    # The fake upstream saw every turn, streamed with usage, the session as a header, no extra body field.
    chats = [r for r in fake_upstream.requests if r.path == "/v1/chat/completions"]
    measured = [r for r in chats if r.json["messages"][0]["content"] != "Hi"]
    assert len(measured) == 6
    assert all(r.json["stream"] and r.json["stream_options"] == {"include_usage": True} for r in measured)
    assert all(
        r.headers["X-Session-Id"].startswith("bench-") and "session_id" not in r.json for r in measured
    )
    assert max(len(r.json["messages"]) for r in measured) == 3  # user, its answer, the next user turn
    assert data["meta"]["workload"]["sessions"] == 3 and data["meta"]["fast_memory_mb"] == 64
    assert report["paths"]["json"] == str(out)


def test_a_peer_given_its_process_group_is_stopped_while_another_server_runs():
    """--peer-pgid: the peer's whole process group is stopped during the other servers' waves and
    resumed for its own and at the end (a real process, its state read from /proc)."""
    import subprocess
    from dataclasses import replace

    from bench.multiturn_servers import target_at
    from bench.peers import alone_on_the_machine

    def stopped(pid: int, expect_stopped: bool) -> bool:
        """Its state in /proc once the signal has landed (delivery is asynchronous: polled until it is
        `expect_stopped`, 5 s at most)."""
        import time

        deadline = time.monotonic() + 5
        while True:
            with open(f"/proc/{pid}/stat") as f:
                is_stopped = f.read().rsplit(")", 1)[1].split()[0] == "T"
            if time.monotonic() > deadline:
                return is_stopped
            time.sleep(0.05)
            if is_stopped == expect_stopped:
                return is_stopped

    peer_process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        peer = replace(target_at("peer", "http://127.0.0.1:1"), pgids=(peer_process.pid,))
        ours = target_at("attnstore", "http://127.0.0.1:2")
        for runs, expect_stopped in ((ours, True), (peer, False), (ours, True), (None, False)):
            alone_on_the_machine([ours, peer], runs)  # None: the end, every server resumed
            assert stopped(peer_process.pid, expect_stopped) == expect_stopped, runs
    finally:
        peer_process.kill()
        peer_process.wait()
