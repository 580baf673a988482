"""The compose topology by hand: two `attnstore serve` processes, one real Redis, one shared L2 folder, and
a client with no affinity at all (every turn on the other replica). Without forwarding each later turn is
an `l2_hit` from the shared disk; with it (`proxy.advertise_url` set) each is served from memory by the
replica holding the conversation, and a killed owner costs no request: the next turn is an `l2_hit` on
the survivor. Every answer equals a recompute."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis
import urllib3

from proxy.http.app import build_full_app
from tests.model_fixture import DEFAULT_DTYPE, MODEL, REPO
from tests.support.processes import UNREACHABLE, ReplicaProcess
from tests.support.threaded_server import free_port
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.model, pytest.mark.redis]

QUESTIONS = ["Name three colors.", "And a fourth?", "Which is warmest?", "Thanks!", "One more color?"]


def start_pair(tmp: Path, redis_url: str, *, forwarding: bool) -> Iterator[list[ReplicaProcess]]:
    l2 = tmp / "shared-l2"
    started: list[ReplicaProcess] = []
    try:
        for name in ("replica-a", "replica-b"):
            settings = {
                "attention_store": {"tiering": {"l2_disk": {"path": str(l2)}}},
                "local_runner": {
                    "kv_chunk_tokens": 16,
                    "cache_dir": str(REPO / "var" / "models"),
                    "device": "cpu",
                    "threads": 1,
                    "compile": False,
                },
                "proxy": {"session_index": redis_url, "replica_id": name},
            }
            started.append(ReplicaProcess(tmp, name, settings, advertise=forwarding))
        yield [r.wait_ready() for r in started]
    finally:
        for r in started:
            r.stop()


@pytest.fixture
def replicas(tmp_path, redis_server):
    yield from start_pair(tmp_path, redis_server.url, forwarding=False)


@pytest.fixture
def forwarding_replicas(tmp_path, redis_server):
    yield from start_pair(tmp_path, redis_server.url, forwarding=True)


@pytest.fixture
def recompute(start_app, make_settings, load_smollm) -> str:
    """The same model with reuse off, in the dtype the replicas run at their default (`auto`: bfloat16
    on a CPU with native bfloat16 arithmetic): what every turn must answer."""
    settings = make_settings(attention_store={"enabled": False}, local_runner={"enabled": True})
    return start_app(build_full_app(settings, models={MODEL: load_smollm(DEFAULT_DTYPE)})).url


def chat(url: str, messages, session: str = "conv-1") -> tuple[str, dict]:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12}
    resp = urllib3.request(
        "POST",
        url + "/v1/chat/completions",
        body=orjson.dumps(body),
        headers={"Content-Type": "application/json", "X-Session-Id": session, "Authorization": "Bearer k"},
        timeout=120,
    )
    assert resp.status == 200, resp.data
    return orjson.loads(resp.data)["choices"][0]["message"]["content"], dict(resp.headers)


def saves_done(url: str) -> bool:
    return orjson.loads(urllib3.request("GET", url + "/v1/attention_store/stats").data)["saves_pending"] == 0


def turn_messages(history: list[dict], question: str) -> list[dict]:
    return [*history, {"role": "user", "content": question}]


def test_alternating_replicas_without_forwarding_hit_l2_and_redis_loss_fails_nothing(
    replicas, redis_server, recompute
):
    a, b = replicas
    history: list[dict] = []
    for turn, question in enumerate(QUESTIONS[:3]):
        here = (a, b)[turn % 2]
        messages = turn_messages(history, question)
        answer, headers = chat(here.url, messages)
        assert headers["X-AttentionStore-Replica"] == here.name
        # Turn 0 computes; every later turn finds the previous one's KV on the shared disk only.
        assert headers["X-AttentionStore-Cache"] == ("miss" if turn == 0 else "l2_hit")
        if turn:
            assert int(headers["X-AttentionStore-Reused-Tokens"]) > 0
            assert answer == chat(recompute, messages)[0]
        history = [*messages, {"role": "assistant", "content": answer}]
        wait_until(lambda h=here: saves_done(h.url), f"{here.name}'s L2 writes", 30, ignore=UNREACHABLE)

    redis_server.stop()  # Redis dies mid-run: both replicas keep answering from what they hold
    _, h3 = chat(a.url, turn_messages(history, QUESTIONS[3]))
    assert h3["X-AttentionStore-Cache"] == "l0_hit"  # replica A served the last turn
    _, h4 = chat(b.url, [{"role": "user", "content": "Another conversation."}], session="conv-2")
    assert h4["X-AttentionStore-Route"] == "local"  # chat() asserted the 200
    health = orjson.loads(urllib3.request("GET", b.url + "/v1/attention_store/stats").data)
    assert health["session_index"] == {"kind": "redis", "connected": False}


def test_alternating_replicas_with_forwarding_hit_memory_and_a_killed_owner_fails_nothing(
    forwarding_replicas, redis_server, recompute
):
    a, b = forwarding_replicas
    r = redis.Redis.from_url(redis_server.url)
    try:
        wait_until(
            lambda: r.exists("attnstore:replica:replica-a", "attnstore:replica:replica-b") == 2,
            "both heartbeats",
            10,
        )
    finally:
        r.close()
    history: list[dict] = []
    for turn, question in enumerate(QUESTIONS[:4]):
        here = (a, b)[turn % 2]
        messages = turn_messages(history, question)
        answer, headers = chat(here.url, messages)
        # Every turn is served by replica A, which holds the conversation: B forwards its turns there.
        assert headers["X-AttentionStore-Replica"] == a.name
        assert headers["X-AttentionStore-Cache"] == ("miss" if turn == 0 else "l0_hit")
        assert answer == chat(recompute, messages)[0]
        history = [*messages, {"role": "assistant", "content": answer}]
    b_stats = orjson.loads(urllib3.request("GET", b.url + "/v1/attention_store/stats").data)
    assert b_stats["misses"] == 0 and sum(b_stats["hits"].values()) == 0  # B never looked anything up

    wait_until(lambda: saves_done(a.url), "replica A's L2 writes", 30, ignore=UNREACHABLE)
    a.kill()  # kill -9: its heartbeat is still in Redis, but nothing answers at its address
    messages = turn_messages(history, QUESTIONS[4])
    answer, headers = chat(b.url, messages)
    assert headers["X-AttentionStore-Replica"] == b.name
    assert headers["X-AttentionStore-Cache"] == "l2_hit"
    assert answer == chat(recompute, messages)[0]
    assert "did not take the turn" in b.log_tail(20000)


def test_unreachable_redis_at_start_degrades_to_the_local_index(start_app, make_settings, smollm):
    settings = make_settings(
        local_runner={"enabled": True, "kv_chunk_tokens": 16},
        proxy={"session_index": f"redis://127.0.0.1:{free_port()}/0"},
    )
    server = start_app(build_full_app(settings, models={MODEL: smollm}))
    first = [{"role": "user", "content": QUESTIONS[0]}]
    answer, h0 = chat(server.url, first)
    assert h0["X-AttentionStore-Cache"] == "miss"
    _, h1 = chat(
        server.url, [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    )
    assert h1["X-AttentionStore-Cache"] == "l0_hit"
