"""The compose topology by hand: two `attnstore serve` processes, one real Redis, one shared L2 folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import urllib3

from proxy.app import build_full_app
from tests.model_fixture import MODEL, REPO
from tests.support.threaded_server import free_port
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.model, pytest.mark.redis]

# A process still starting, or a connection refused: not ready yet.
UNREACHABLE = (urllib3.exceptions.HTTPError, OSError)
FIRST = [{"role": "user", "content": "Name three colors."}]


class Replica:
    """`python -m proxy serve` in its own process, as docker-compose runs each replica."""

    def __init__(self, tmp: Path, name: str, redis_url: str, l2: Path):
        self.port = free_port()
        settings = {
            "attention_store": {"tiering": {"l2_disk": {"path": str(l2)}}},
            "local_runner": {
                "kv_chunk_tokens": 16,
                "cache_dir": str(REPO / "var" / "models"),
                "device": "cpu",
                "threads": 1,
            },
            "proxy": {"session_index": redis_url, "replica_id": name},
        }
        self.settings_file = tmp / f"{name}.json"
        self.settings_file.write_bytes(orjson.dumps(settings))
        self.log = (tmp / f"{name}.log").open("wb")
        env = {k: v for k, v in os.environ.items() if k != "ATTNSTORE_REDIS_URL"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--settings",
                str(self.settings_file),
                "--port",
                str(self.port),
            ],
            cwd=tmp,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> Replica:
        wait_until(
            lambda: urllib3.request("GET", self.url + "/healthz", timeout=1, retries=False).status == 200,
            "replica",
            120,
            interval=0.1,
            ignore=UNREACHABLE,
        )
        return self

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def replicas(tmp_path, redis_server):
    l2 = tmp_path / "shared-l2"
    started = [Replica(tmp_path, name, redis_server.url, l2) for name in ("replica-a", "replica-b")]
    try:
        yield [r.wait_ready() for r in started]
    finally:
        for r in started:
            r.stop()


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


def test_turn_on_the_other_replica_is_an_l2_hit_and_redis_loss_fails_nothing(
    replicas, redis_server, start_app, make_settings, smollm
):
    a, b = replicas
    answer0, h0 = chat(a.url, FIRST)
    assert h0["X-AttentionStore-Cache"] == "miss"
    wait_until(lambda: saves_done(a.url), "replica A's L2 writes", 30, ignore=UNREACHABLE)

    history = [
        *FIRST,
        {"role": "assistant", "content": answer0},
        {"role": "user", "content": "And a fourth?"},
    ]
    answer1, h1 = chat(b.url, history)
    assert h1["X-AttentionStore-Cache"] == "l2_hit"
    assert int(h1["X-AttentionStore-Reused-Tokens"]) > 0

    recompute = start_app(
        build_full_app(
            make_settings(attention_store={"enabled": False}, local_runner={"enabled": True}),
            models={MODEL: smollm},
        )
    )
    expected, _ = chat(recompute.url, history)
    assert answer1 == expected

    redis_server.stop()  # Redis dies mid-run: both replicas keep answering from what they hold
    history2 = [*history, {"role": "assistant", "content": answer1}, {"role": "user", "content": "Thanks!"}]
    _, h2 = chat(b.url, history2)
    assert h2["X-AttentionStore-Cache"] == "l0_hit"
    _, h3 = chat(a.url, [{"role": "user", "content": "Another conversation."}], session="conv-2")
    assert h3["X-AttentionStore-Route"] == "local"  # chat() asserted the 200
    health = orjson.loads(urllib3.request("GET", b.url + "/v1/attention_store/stats").data)
    assert health["session_index"] == {"kind": "redis", "connected": False}


def test_unreachable_redis_at_start_degrades_to_the_local_index(start_app, make_settings, smollm):
    settings = make_settings(
        local_runner={"enabled": True, "kv_chunk_tokens": 16},
        proxy={"session_index": f"redis://127.0.0.1:{free_port()}/0"},
    )
    server = start_app(build_full_app(settings, models={MODEL: smollm}))
    answer, h0 = chat(server.url, FIRST)
    assert h0["X-AttentionStore-Cache"] == "miss"
    _, h1 = chat(
        server.url, [*FIRST, {"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    )
    assert h1["X-AttentionStore-Cache"] == "l0_hit"
