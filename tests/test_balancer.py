"""The compose file's balancer for real: HAProxy (Debian's package) with deploy/haproxy.cfg, on loopback,
in front of two `attnstore serve` processes (upstream-only: no model, the fake upstream answers). One
address for everything, the same replica for every request of a session, the least busy one without a
session, failover when a replica stops, and keys from the environment as compose passes them."""

from __future__ import annotations

import threading

import orjson
import pytest
import urllib3

from tests.support.processes import HAPROXY, HAProxy, ReplicaProcess
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy; .ci/run installs it)"
)

KEY = "lb-test-key"
REPLICA = "X-AttentionStore-Replica"


@pytest.fixture
def topology(tmp_path, fake_upstream):
    """HAProxy in front of replica-a and replica-b; yields (haproxy, {name: replica})."""
    started: list[ReplicaProcess | HAProxy] = []
    try:
        for name in ("replica-a", "replica-b"):
            settings = {
                "attention_store": {"tiering": {"l2_disk": {"path": str(tmp_path / "kv")}}},
                "llm_endpoint": {"base_url": fake_upstream.url + "/v1"},
                "local_runner": {"enabled": False},
                "proxy": {"replica_id": name},
            }
            started.append(ReplicaProcess(tmp_path, name, settings, env={"ATTNSTORE_API_KEYS": KEY}))
        reps = {r.name: r.wait_ready() for r in started if isinstance(r, ReplicaProcess)}
        lb = HAProxy(tmp_path, reps["replica-a"].url[7:], reps["replica-b"].url[7:])
        started.append(lb)
        yield lb.wait_ready(), reps
    finally:
        for proc in reversed(started):
            proc.stop()


def chat(
    url: str, session: str | None = None, key: str = KEY, stream: bool = False, **kw
) -> urllib3.BaseHTTPResponse:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    if session is not None:
        headers["X-Session-Id"] = session
    headers.update(kw.pop("headers", {}))
    body = {"model": "gpt-fake", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    return urllib3.request(
        "POST",
        url + "/v1/chat/completions",
        body=orjson.dumps(body),
        headers=headers,
        timeout=10,
        retries=False,
        **kw,
    )


def served_by(url: str, session: str | None = None) -> str:
    resp = chat(url, session)
    assert resp.status == 200, resp.data
    return resp.headers[REPLICA]


def test_one_address_hashes_sessions_and_needs_keys(topology, fake_upstream):
    lb, reps = topology
    where = {f"sess-{i}": served_by(lb.url, f"sess-{i}") for i in range(24)}
    assert set(where.values()) == set(reps)  # both replicas take a share of the sessions
    for _ in range(2):  # and every later request of a session reaches the same one
        assert {s: served_by(lb.url, s) for s in where} == where
    # Everything else through the same address: health (no key), models (key), auth refused without one.
    assert urllib3.request("GET", lb.url + "/healthz").status == 200
    models = urllib3.request("GET", lb.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models.status == 200 and orjson.loads(models.data)["object"] == "list"
    assert chat(lb.url, "sess-0", key="wrong").status == 401
    # Only replicas mark a turn as forwarded: the balancer drops a client's claim.
    resp = chat(lb.url, "sess-0", headers={"X-AttentionStore-Forwarded-By": "replica-a", "X-Other": "1"})
    assert resp.status == 200
    seen = fake_upstream.requests[-1].headers
    assert "X-AttentionStore-Forwarded-By" not in seen and seen["X-Other"] == "1"


def test_without_a_session_the_least_busy_replica_takes_the_request(topology, fake_upstream):
    lb, _ = topology
    fake_upstream.stall_after = 1  # the next stream sends its first event, then holds its replica
    held = chat(lb.url, stream=True, preload_content=False)
    try:
        assert held.status == 200
        busy = held.headers[REPLICA]
        fake_upstream.stall_after = -1
        # Each answer finishes before the next is sent: the other replica always has fewer in flight.
        assert {served_by(lb.url) for _ in range(4)} == ({"replica-a", "replica-b"} - {busy})
    finally:
        held.release_conn()
        held.close()


def test_a_stopped_replica_fails_no_request_and_its_sessions_move(topology):
    lb, reps = topology
    where = {f"sess-{i}": served_by(lb.url, f"sess-{i}") for i in range(16)}
    gone, kept = "replica-a", "replica-b"
    reps[gone].stop()
    # At once, before any health check noticed: a refused connection is retried on the other replica.
    for session in where:
        assert served_by(lb.url, session) == kept
    # Once the checks mark it down, the balancer no longer tries it; the survivor's sessions never moved.
    wait_until(lambda: "is DOWN" in lb.log_path.read_text(), "the health check to take replica-a out", 15)
    assert {s: served_by(lb.url, s) for s in where} == {s: kept for s in where}


def test_concurrent_clients_on_one_address_all_succeed(topology):
    lb, reps = topology
    statuses: list[int] = []

    def client(n: int) -> None:
        for _ in range(5):
            statuses.append(chat(lb.url, f"conc-{n}" if n % 2 else None).status)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert statuses == [200] * 30
