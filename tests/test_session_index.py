"""The session index on its own (no model, no proxy): memory, and Redis against a real redis-server."""

from __future__ import annotations

import logging

import proxy.cluster.session_index as session_index
from proxy.cluster.session_index import (
    MemorySessionIndex,
    RedisSessionIndex,
    SessionRecord,
    open_session_index,
)
from tests.support.threaded_server import free_port


def record(
    replica: str = "replica-a", keys: tuple[str, ...] = ("k1", "k2"), tokens: int = 64
) -> SessionRecord:
    return SessionRecord(replica=replica, tier="l0", chunk_keys=list(keys), tokens=tokens, updated=1000.0)


async def test_memory_index_is_per_tenant_and_bounded():
    index = MemorySessionIndex(max_sessions=2)
    await index.put("t1", "s", record())
    assert await index.get("t1", "s") == record()
    assert await index.get("t2", "s") is None  # another tenant's session of the same name
    await index.put("t1", "s2", record())
    await index.put("t1", "s3", record())  # the oldest session goes
    assert await index.get("t1", "s") is None and await index.get("t1", "s3") is not None
    await index.forget("t1", "s3")
    assert await index.get("t1", "s3") is None
    assert index.describe() == {"kind": "memory", "sessions": 1, "responses": 0}


def test_open_session_index_picks_the_kind():
    assert isinstance(open_session_index("memory"), MemorySessionIndex)
    assert isinstance(open_session_index("redis://127.0.0.1:1/0"), RedisSessionIndex)


async def test_replicas_share_records_through_redis(redis_server):
    a, b = RedisSessionIndex(redis_server.url), RedisSessionIndex(redis_server.url)
    try:
        written = record(keys=("c0", "c1", "c2"), tokens=300)
        await a.put("tenant", "conv", written)
        got = await b.get("tenant", "conv")  # b never saw the put: it can only come from Redis
        assert got == written
        assert await b.get("other-tenant", "conv") is None
        await b.forget("tenant", "conv")
        assert await b.get("tenant", "conv") is None
        third = RedisSessionIndex(redis_server.url)  # only Redis could tell it: gone from there too
        try:
            assert await third.get("tenant", "conv") is None
        finally:
            await third.close()
        assert a.describe() == {"kind": "redis", "connected": True}
    finally:
        await a.close()
        await b.close()


async def test_redis_loss_degrades_to_the_local_copy_and_recovers(redis_server, monkeypatch, caplog):
    monkeypatch.setattr(session_index, "_RETRY_SECONDS", 0.0)  # retry Redis at once once it is back
    index = RedisSessionIndex(redis_server.url)
    try:
        await index.put("t", "before", record(tokens=1))
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="attnstore.index"):
            assert await index.get("t", "before") == record(tokens=1)  # the local copy answers
            await index.put("t", "during", record(tokens=2))  # no error reaches the caller
            assert await index.get("t", "during") == record(tokens=2)
        assert index.describe() == {"kind": "redis", "connected": False}
        assert sum("Redis unavailable" in r.getMessage() for r in caplog.records) == 1  # one warning

        redis_server.start()  # the same port, empty: what Redis lost, the local copy still knows
        assert await index.get("t", "during") == record(tokens=2)
        assert index.describe() == {"kind": "redis", "connected": True}
        await index.put("t", "after", record(tokens=3))
        fresh = RedisSessionIndex(redis_server.url)
        try:
            assert await fresh.get("t", "after") == record(tokens=3)
        finally:
            await fresh.close()
    finally:
        await index.close()


async def test_unreachable_redis_never_fails_a_call():
    index = RedisSessionIndex(f"redis://127.0.0.1:{free_port()}/0", timeout=0.2)
    try:
        await index.put("t", "s", record())
        assert await index.get("t", "s") == record()
        await index.forget("t", "s")
        assert await index.get("t", "s") is None
        assert index.describe() == {"kind": "redis", "connected": False}
    finally:
        await index.close()


async def test_stored_responses_are_per_tenant_and_the_oldest_go_first():
    index = MemorySessionIndex()
    for i in range(3):
        await index.put_response("t1", f"resp_{i}", f"doc {i}".encode(), keep=2)
    assert await index.get_response("t1", "resp_0") is None  # the oldest went
    assert await index.get_response("t1", "resp_2") == b"doc 2"
    assert await index.get_response("t2", "resp_2") is None  # another tenant's id is not found
    assert await index.delete_response("t1", "resp_2") and not await index.delete_response("t1", "resp_2")


async def test_replicas_share_stored_responses_through_redis_bounded(redis_server):
    a, b = RedisSessionIndex(redis_server.url), RedisSessionIndex(redis_server.url)
    try:
        for i in range(3):
            await a.put_response("t1", f"resp_{i}", f"doc {i}".encode(), keep=2)
        assert await b.get_response("t1", "resp_1") == b"doc 1"  # the other replica finds it
        assert await b.get_response("t1", "resp_0") is None  # bounded across replicas, oldest first
        assert await b.get_response("t2", "resp_1") is None
        assert await b.delete_response("t1", "resp_1")
        assert await a.get_response("t1", "resp_1") is None  # deleted on b: gone for a too
    finally:
        await a.close()
        await b.close()
