"""KV-aware forwarding between replicas without a model: two proxies in-process with stand-in local
backends, one real redis-server. What the owner receives, what the client gets back (chunk by chunk),
and every case where the turn stays where it landed (one hop, a busier owner, a dead or full owner, a
session not held in memory, no Redis). The same with real replica processes: test_replicas.py."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
import urllib3
from aiohttp import web

from proxy.cluster.forwarding import FORWARDED_BY, FORWARDER, forward_target
from proxy.cluster.session_index import MemorySessionIndex, RedisSessionIndex, ReplicaInfo, SessionRecord
from proxy.errors import APIError
from proxy.http.app import build_app
from proxy.metrics import METRICS
from proxy.serving.response_store import ResponseStore, StoredResponse
from proxy.turns.backend import LocalBackend
from proxy.turns.tenant import tenant_of
from tests.support.threaded_server import AppServer, free_port
from tests.support.waiting import wait_until

KEY = "client-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TENANT = tenant_of(AUTH)
MODEL = "local-model"


class Load:
    """The engine as forwarding sees it: its load (jobs queued or running); no prompt bound, no stats.
    `held`: the sessions (tenant, session) -> chunks it holds, which a DELETE forgets."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.held: dict[tuple[str, str], int] = {}

    def forget_session(self, tenant: str, session: str) -> int:
        return self.held.pop((tenant, session), 0)

    def load(self) -> int:
        return self.jobs

    def max_context_tokens(self) -> int:
        return 0

    def stats(self) -> None:
        return None


class StandIn(LocalBackend):
    """A local backend through the seam: answers a two-event SSE stream, an l0 hit with a TTFT of 1 ms.
    `gate`: the second event waits for it (proves the forwarder streams, not buffers).
    `mode`: "full" answers 503 queue_full, "drop" closes the connection before answering.
    `load`: the jobs its engine reports queued or running."""

    def __init__(self, name: str, mode: str = "ok", gate: threading.Event | None = None, load: int = 0):
        self.name = name
        self.mode = mode
        self.gate = gate
        self._engine = Load(load)
        self.seen: list[tuple[dict[str, str], bytes, Any]] = []

    @property
    def engine(self) -> Any:
        return self._engine

    def supports(self, chat) -> str | None:
        return None

    async def handle(self, request: web.Request, chat, turn) -> web.StreamResponse:
        self.seen.append((dict(request.headers), chat.raw, turn))
        if self.mode == "full":
            raise APIError(503, "The local queue is full; retry later.", code="queue_full")
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        at = turn.received_at + 0.001
        turn.local_first_token(cache="l0", reused=5, prompt=8, tiers={"l0": 5}, position_shift=0, at=at)
        resp = web.StreamResponse(headers=turn.headers())
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        if self.gate is not None:
            await asyncio.to_thread(self.gate.wait, 30)
        await resp.write(b"data: two\n\n")
        await resp.write_eof()
        return resp


def with_index(url: str, use: Callable[[RedisSessionIndex], Awaitable[Any]]) -> Any:
    """Run `use(index)` on a fresh loop with a fresh client (the apps' indexes live on their own loops)."""

    async def run() -> Any:
        index = RedisSessionIndex(url)
        try:
            return await use(index)
        finally:
            await index.close()

    return asyncio.run(run())


def own(url: str, session: str, replica: str, tier: str = "l0") -> None:
    record = SessionRecord(replica=replica, tier=tier, chunk_keys=["c0"], tokens=32)
    with_index(url, lambda index: index.put(TENANT, session, record))


def announce(url: str, replica: str, info: ReplicaInfo, ttl_s: float = 60) -> None:
    with_index(url, lambda index: index.announce(replica, info, ttl_s))


def heartbeat_of(url: str, replica: str) -> ReplicaInfo | None:
    return with_index(url, lambda index: index.replica(replica))


@pytest.fixture
def replica(redis_server, start_app, make_settings):
    """start(name, backend, advertise=True, **proxy settings) -> (server, app): a replica on Redis."""

    def start(name: str, backend: StandIn, advertise: bool = True, **proxy: Any):
        port = free_port()
        settings = make_settings(
            local_runner={"enabled": True, "models": {MODEL: "/nowhere.gguf"}},
            proxy={
                "session_index": redis_server.url,
                "replica_id": name,
                "api_keys": [KEY],
                "advertise_url": f"http://127.0.0.1:{port}" if advertise else "",
                "heartbeat_s": 0.2,
                **proxy,
            },
        )
        app = build_app(settings, local=lambda: backend, index=RedisSessionIndex(redis_server.url))
        return start_app(app, port=port), app

    return start


def chat(
    url: str, session: str, headers: dict[str, str] | None = None, **kw: Any
) -> urllib3.BaseHTTPResponse:
    body = {
        "model": MODEL,
        "session_id": session,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    return urllib3.request(
        "POST",
        url + "/v1/chat/completions",
        body=orjson.dumps(body),
        headers={"Content-Type": "application/json", **AUTH, **(headers or {})},
        timeout=30,
        retries=False,
        **kw,
    )


def test_a_replica_is_announced_only_once_its_local_serving_has_started(redis_server, make_settings):
    """A replica still starting would be sent the turns of the sessions its records name it for, and
    hold them for its whole start: its heartbeat waits for the start."""
    started = threading.Event()

    def build() -> LocalBackend:
        assert started.wait(30)
        return StandIn("replica-s")

    port = free_port()
    settings = make_settings(
        local_runner={"enabled": True, "models": {MODEL: "/nowhere.gguf"}},
        proxy={
            "session_index": redis_server.url,
            "replica_id": "replica-s",
            "api_keys": [KEY],
            "advertise_url": f"http://127.0.0.1:{port}",
            "heartbeat_s": 0.2,
        },
    )
    app = build_app(settings, local=build, index=RedisSessionIndex(redis_server.url))
    with AppServer(app, port=port) as server:
        assert urllib3.request("GET", server.url + "/healthz", retries=False).status == 503
        time.sleep(1.0)  # five beats' time
        assert heartbeat_of(redis_server.url, "replica-s") is None
        started.set()
        wait_until(lambda: heartbeat_of(redis_server.url, "replica-s"), "replica-s's heartbeat", 10)


def test_a_turn_goes_to_the_live_owner_as_is_and_streams_back_chunk_by_chunk(replica, redis_server):
    gate = threading.Event()
    here, there = StandIn("replica-x"), StandIn("replica-o", gate=gate)
    x, x_app = replica("replica-x", here)
    replica("replica-o", there)
    wait_until(lambda: heartbeat_of(redis_server.url, "replica-o"), "replica-o's heartbeat", 10)
    own(redis_server.url, "conv", "replica-o")

    resp = chat(x.url, "conv", {"X-Client-Thing": "kept"}, preload_content=False)
    assert resp.status == 200
    assert resp.headers["X-AttentionStore-Replica"] == "replica-o"  # the owner's headers pass through
    assert resp.headers["X-AttentionStore-Cache"] == "l0_hit"
    assert float(resp.headers["X-AttentionStore-TTFT-Ms"]) >= 1.0  # the owner's 1.0 plus the hop
    # The owner's first event reaches the client while the owner still holds back the second one.
    assert resp.read1() == b"data: one\n\n"
    gate.set()
    assert resp.read() == b"data: two\n\n"
    resp.release_conn()

    assert here.seen == [] and len(there.seen) == 1
    headers, raw, turn = there.seen[0]
    assert headers[FORWARDED_BY] == "replica-x"
    assert headers["Authorization"] == AUTH["Authorization"] and headers["X-Client-Thing"] == "kept"
    assert orjson.loads(raw)["session_id"] == "conv"  # the body as the client sent it
    assert turn.session == "conv" and turn.tenant == TENANT
    assert 'attnstore_forwarded_turns_total{outcome="forwarded"} 1.0' in x_app[METRICS].render().decode()


def test_a_forwarded_turn_is_served_where_it_lands(replica, redis_server):
    here, there = StandIn("replica-x"), StandIn("replica-o")
    x, _ = replica("replica-x", here)
    replica("replica-o", there)
    wait_until(lambda: heartbeat_of(redis_server.url, "replica-o"), "replica-o's heartbeat", 10)
    own(redis_server.url, "conv", "replica-o")
    resp = chat(x.url, "conv", {FORWARDED_BY: "replica-o"})
    assert resp.status == 200 and resp.headers["X-AttentionStore-Replica"] == "replica-x"
    assert there.seen == [] and len(here.seen) == 1


def test_a_much_busier_owner_leaves_the_turn_here(replica, redis_server):
    here, there = StandIn("replica-x"), StandIn("replica-o")
    x, _ = replica("replica-x", here, forward_max_queue_gap=2)
    o, _ = replica("replica-o", there, advertise=False)  # its load is what the test announces
    own(redis_server.url, "conv", "replica-o")
    announce(redis_server.url, "replica-o", ReplicaInfo(url=o.url, load=3))
    assert chat(x.url, "conv").headers["X-AttentionStore-Replica"] == "replica-x"
    announce(redis_server.url, "replica-o", ReplicaInfo(url=o.url, load=2))  # exactly the gap: still there
    assert chat(x.url, "conv").headers["X-AttentionStore-Replica"] == "replica-o"
    assert len(here.seen) == 1 and len(there.seen) == 1


@pytest.mark.parametrize("owner", ["dead", "full", "drops"])
def test_a_dead_full_or_failing_owner_costs_one_attempt_never_the_request(
    replica, redis_server, owner, caplog
):
    caplog.set_level(logging.INFO, logger="attnstore.forwarding")
    here = StandIn("replica-x")
    x, x_app = replica("replica-x", here)
    if owner == "dead":  # its heartbeat has not expired yet, but nothing listens there any more
        url = f"http://127.0.0.1:{free_port()}"
        there = None
    else:
        there = StandIn("replica-o", mode="full" if owner == "full" else "drop")
        url = replica("replica-o", there, advertise=False)[0].url
    announce(redis_server.url, "replica-o", ReplicaInfo(url=url))
    own(redis_server.url, "conv", "replica-o")
    resp = chat(x.url, "conv")
    assert resp.status == 200 and resp.headers["X-AttentionStore-Replica"] == "replica-x"
    assert resp.data == b"data: one\n\ndata: two\n\n"
    assert len(here.seen) == 1
    if there is not None:
        assert len(there.seen) == 1  # one attempt, not a retry loop
    tried = [r for r in caplog.records if r.name == "attnstore.forwarding" and "replica-o" in r.getMessage()]
    assert len(tried) == 1
    text = x_app[METRICS].render().decode()
    assert 'attnstore_forwarded_turns_total{outcome="served_here"} 1.0' in text


@pytest.mark.parametrize("case", ["l2", "mine", "expired"])
def test_a_session_not_hot_elsewhere_is_served_here(replica, redis_server, case):
    here, there = StandIn("replica-x"), StandIn("replica-o")
    x, _ = replica("replica-x", here)
    replica("replica-o", there, advertise=False)
    if case == "l2":  # the owner has only the shared disk's copy: no better than this replica
        announce(redis_server.url, "replica-o", ReplicaInfo(url=x.url))
        own(redis_server.url, "conv", "replica-o", tier="l2")
    elif case == "mine":
        own(redis_server.url, "conv", "replica-x")
    else:  # the owner's heartbeat expired: it is gone
        announce(redis_server.url, "replica-o", ReplicaInfo(url=x.url), ttl_s=0.05)
        wait_until(lambda: heartbeat_of(redis_server.url, "replica-o") is None, "the heartbeat to expire", 10)
        own(redis_server.url, "conv", "replica-o")
    assert chat(x.url, "conv").headers["X-AttentionStore-Replica"] == "replica-x"
    assert there.seen == []


def test_the_heartbeat_announces_address_and_load_and_is_withdrawn_at_stop(replica, redis_server):
    # The load is read at each beat: what local serving has queued and running.
    x, _ = replica("replica-x", StandIn("replica-x", load=3))
    wait_until(
        lambda: (heartbeat_of(redis_server.url, "replica-x") or ReplicaInfo("")).load == 3, "a beat", 10
    )
    info = heartbeat_of(redis_server.url, "replica-x")
    assert info is not None and info.url == x.url
    x.stop()
    assert heartbeat_of(redis_server.url, "replica-x") is None  # gone at once, not after its TTL


def test_a_session_deleted_on_one_replica_is_forgotten_by_every_live_one(replica, redis_server):
    """DELETE /v1/attention_store/sessions/{id} on one replica: the others drop their own copies too
    (each holds its memory tiers apart), once each, with the caller's key; a dead replica costs nothing."""
    here, there, other = StandIn("replica-x"), StandIn("replica-o"), StandIn("replica-p")
    x, _ = replica("replica-x", here)
    replica("replica-o", there)
    replica("replica-p", other)
    for name in ("replica-o", "replica-p"):
        wait_until(lambda name=name: heartbeat_of(redis_server.url, name), f"{name}'s heartbeat", 10)
    announce(redis_server.url, "replica-dead", ReplicaInfo(url="http://127.0.0.1:1"))
    here.engine.held[(TENANT, "conv")] = 2
    there.engine.held[(TENANT, "conv")] = 3
    there.engine.held[("another-tenant", "conv")] = 7  # another tenant's session of the same name
    url = x.url + "/v1/attention_store/sessions/conv"
    r = urllib3.request("DELETE", url, headers=AUTH, timeout=30, retries=False)
    assert r.status == 200 and r.json() == {
        "id": "conv",
        "object": "attention_store.session.deleted",
        "deleted": True,
        "chunks": 5,
    }
    assert here.engine.held == {} and there.engine.held == {("another-tenant", "conv"): 7}
    # Held only elsewhere: still deleted; then nothing is left anywhere.
    other.engine.held[(TENANT, "conv")] = 1
    assert urllib3.request("DELETE", url, headers=AUTH, timeout=30, retries=False).json()["chunks"] == 1
    again = urllib3.request("DELETE", url, headers=AUTH, timeout=30, retries=False).json()
    assert (again["deleted"], again["chunks"]) == (False, 0)


def test_a_response_deleted_on_one_replica_is_forgotten_by_every_live_one(replica, redis_server):
    """DELETE /v1/responses/{id} on a replica that did not serve the turn: the stored response is gone
    from the shared index, and the replica that served it drops its own copies of the turn's KV."""
    here, there = StandIn("replica-x"), StandIn("replica-o")
    x, _ = replica("replica-x", here)
    replica("replica-o", there)
    wait_until(lambda: heartbeat_of(redis_server.url, "replica-o"), "replica-o's heartbeat", 10)
    stored = StoredResponse(model=MODEL, conversation=[], response={"id": "resp_1", "object": "response"})
    with_index(redis_server.url, lambda index: ResponseStore(index, 10).put(TENANT, "resp_1", stored))
    there.engine.held[(TENANT, "resp_1")] = 4  # the turn was served there
    url = x.url + "/v1/responses/resp_1"
    r = urllib3.request("DELETE", url, headers=AUTH, timeout=30, retries=False)
    assert r.status == 200 and r.json() == {"id": "resp_1", "object": "response", "deleted": True}
    assert there.engine.held == {}
    assert urllib3.request("GET", url, headers=AUTH, timeout=30, retries=False).status == 404


def test_without_redis_nothing_changes(make_settings):
    settings = make_settings(
        local_runner={"enabled": True, "models": {MODEL: "/nowhere.gguf"}},
        proxy={"advertise_url": "http://127.0.0.1:1"},
    )
    app = build_app(settings, local=lambda: StandIn("x"), index=MemorySessionIndex())
    assert FORWARDER not in app
    assert "heartbeat" not in [getattr(ctx, "__name__", "") for ctx in app.cleanup_ctx]


def test_forward_target_weighs_the_owner_against_its_load():
    hot = SessionRecord(replica="o", tier="l1")
    live = ReplicaInfo(url="http://o:8080/", load=5)
    assert forward_target(hot, live, me="x", own_load=1, max_gap=4) == "http://o:8080"
    assert forward_target(hot, live, me="x", own_load=0, max_gap=4) is None
    assert forward_target(hot, None, me="x", own_load=0, max_gap=4) is None
    assert forward_target(SessionRecord(replica="o", tier="l2"), live, me="x", own_load=9, max_gap=4) is None
    assert forward_target(SessionRecord(replica="x", tier="l0"), live, me="x", own_load=9, max_gap=4) is None
