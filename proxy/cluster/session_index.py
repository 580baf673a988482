"""The session index: which replica and tier last held each session's KV chunks, and their keys, and
which replicas are alive (each announces its address and load with a heartbeat that expires).

Replicas that share one L2 folder learn each other's chunk keys here, so a turn that lands on another
replica still finds the conversation's KV on disk (an `l2_hit`). The in-memory index is the embedded
default; Redis shares it across replicas. Redis is a helper, never a dependency of a request: when it
fails, the index answers from its local copy, logs one warning, and uses Redis again once it answers.
The index also keeps the Responses API's stored responses (`put_response`, `get_response`,
`delete_response`): opaque bytes per tenant and response id, the oldest dropped first past a bound, so
a follow-up that lands on another replica finds its conversation. Replicas are known through Redis
only: without it (or while it is down) no replica knows another, and every turn is served where it
lands.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

import orjson
from aiohttp import web

log = logging.getLogger("attnstore.index")

_TTL_SECONDS = 7 * 24 * 3600
_RETRY_SECONDS = 5.0


@dataclass
class SessionRecord:
    replica: str
    tier: str
    chunk_keys: list[str] = field(default_factory=list)
    tokens: int = 0
    updated: float = field(default_factory=time.time)


@dataclass
class ReplicaInfo:
    """What a replica announces with each heartbeat."""

    url: str  # where the other replicas reach it (proxy.advertise_url)
    load: int = 0  # jobs queued or running on its local runner
    updated: float = field(default_factory=time.time)


class SessionIndex(Protocol):
    # True when other replicas see what this index records (Redis); False for the in-memory index.
    shared: bool

    async def get(self, tenant: str, session: str) -> SessionRecord | None: ...
    async def put(self, tenant: str, session: str, record: SessionRecord) -> None: ...
    async def forget(self, tenant: str, session: str) -> None: ...
    async def put_response(self, tenant: str, response_id: str, doc: bytes, *, keep: int) -> None:
        """Store a response; past `keep` stored responses (all tenants together) the oldest go."""
        ...

    async def get_response(self, tenant: str, response_id: str) -> bytes | None: ...
    async def delete_response(self, tenant: str, response_id: str) -> bool: ...
    async def announce(self, replica: str, info: ReplicaInfo, ttl_s: float) -> None: ...
    async def replica(self, replica: str) -> ReplicaInfo | None: ...
    async def replicas(self) -> dict[str, ReplicaInfo]:
        """Every replica whose heartbeat is live, by id (none where the index cannot tell)."""
        ...

    async def withdraw(self, replica: str) -> None: ...
    async def close(self) -> None: ...
    def describe(self) -> dict: ...


class MemorySessionIndex:
    """A dict, bounded so that a flood of one-turn sessions cannot grow it without end."""

    shared = False

    def __init__(self, max_sessions: int = 100_000):
        self._records: dict[tuple[str, str], SessionRecord] = {}
        self._max = max_sessions
        self._responses: dict[tuple[str, str], bytes] = {}  # insertion order: the oldest first

    async def get(self, tenant: str, session: str) -> SessionRecord | None:
        return self._records.get((tenant, session))

    async def put(self, tenant: str, session: str, record: SessionRecord) -> None:
        self._records.pop((tenant, session), None)
        self._records[(tenant, session)] = record
        while len(self._records) > self._max:
            self._records.pop(next(iter(self._records)))

    async def forget(self, tenant: str, session: str) -> None:
        self._records.pop((tenant, session), None)

    async def put_response(self, tenant: str, response_id: str, doc: bytes, *, keep: int) -> None:
        self._responses.pop((tenant, response_id), None)
        self._responses[(tenant, response_id)] = doc
        while len(self._responses) > keep:
            self._responses.pop(next(iter(self._responses)))

    async def get_response(self, tenant: str, response_id: str) -> bytes | None:
        return self._responses.get((tenant, response_id))

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        return self._responses.pop((tenant, response_id), None) is not None

    # One process, no other replica to know of.
    async def announce(self, replica: str, info: ReplicaInfo, ttl_s: float) -> None:
        pass

    async def replica(self, replica: str) -> ReplicaInfo | None:
        return None

    async def replicas(self) -> dict[str, ReplicaInfo]:
        return {}

    async def withdraw(self, replica: str) -> None:
        pass

    async def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"kind": "memory", "sessions": len(self._records), "responses": len(self._responses)}


class RedisSessionIndex:
    """Redis first, the local copy when Redis cannot answer (and for what was written meanwhile)."""

    shared = True

    def __init__(self, url: str, *, timeout: float = 0.5):
        import redis.asyncio as redis

        self._redis = redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._local = MemorySessionIndex()
        self._down_since: float | None = None
        self._retry_at = 0.0

    @staticmethod
    def _key(tenant: str, session: str) -> str:
        return f"attnstore:session:{tenant}:{session}"

    @staticmethod
    def _response_key(tenant: str, response_id: str) -> str:
        return f"attnstore:response:{tenant}:{response_id}"

    # Every stored response's key, scored by when it was stored: the bound drops the lowest scores.
    _RESPONSES_BY_AGE = "attnstore:responses"

    @staticmethod
    def _replica_key(replica: str) -> str:
        return f"attnstore:replica:{replica}"

    def _usable(self) -> bool:
        return self._down_since is None or time.monotonic() >= self._retry_at

    def _failed(self, exc: Exception) -> None:
        if self._down_since is None:
            log.warning("session index: Redis unavailable (%s); using the local index until it is back", exc)
            self._down_since = time.monotonic()
        self._retry_at = time.monotonic() + _RETRY_SECONDS

    def _recovered(self) -> None:
        if self._down_since is not None:
            log.warning("session index: Redis is back after %.1f s", time.monotonic() - self._down_since)
            self._down_since = None

    async def get(self, tenant: str, session: str) -> SessionRecord | None:
        if self._usable():
            try:
                raw = await self._redis.get(self._key(tenant, session))
                self._recovered()
                if raw:
                    return SessionRecord(**orjson.loads(raw))
            except Exception as exc:  # any Redis failure degrades to the local copy
                self._failed(exc)
        return await self._local.get(tenant, session)

    async def put(self, tenant: str, session: str, record: SessionRecord) -> None:
        await self._local.put(tenant, session, record)
        if self._usable():
            try:
                await self._redis.set(
                    self._key(tenant, session), orjson.dumps(asdict(record)), ex=_TTL_SECONDS
                )
                self._recovered()
            except Exception as exc:
                self._failed(exc)

    async def forget(self, tenant: str, session: str) -> None:
        await self._local.forget(tenant, session)
        if self._usable():
            try:
                await self._redis.delete(self._key(tenant, session))
                self._recovered()
            except Exception as exc:
                self._failed(exc)

    async def put_response(self, tenant: str, response_id: str, doc: bytes, *, keep: int) -> None:
        await self._local.put_response(tenant, response_id, doc, keep=keep)
        if not self._usable():
            return
        key = self._response_key(tenant, response_id)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(key, doc, ex=_TTL_SECONDS)
                pipe.zadd(self._RESPONSES_BY_AGE, {key: time.time()})
                pipe.zcard(self._RESPONSES_BY_AGE)
                *_, count = await pipe.execute()
            if count > keep:
                oldest = await self._redis.zpopmin(self._RESPONSES_BY_AGE, count - keep)
                members = [entry[0] for entry in oldest if isinstance(entry, tuple | list)]
                if members:
                    await self._redis.delete(*members)
            self._recovered()
        except Exception as exc:
            self._failed(exc)

    async def get_response(self, tenant: str, response_id: str) -> bytes | None:
        """Redis's answer whenever it gives one (a response deleted on another replica stays deleted);
        the local copy only while Redis is down."""
        if self._usable():
            try:
                raw = await self._redis.get(self._response_key(tenant, response_id))
                self._recovered()
                return None if raw is None else raw if isinstance(raw, bytes) else str(raw).encode()
            except Exception as exc:
                self._failed(exc)
        return await self._local.get_response(tenant, response_id)

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        deleted = await self._local.delete_response(tenant, response_id)
        if self._usable():
            key = self._response_key(tenant, response_id)
            try:
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.delete(key)
                    pipe.zrem(self._RESPONSES_BY_AGE, key)
                    removed, _ = await pipe.execute()
                deleted = deleted or bool(removed)
                self._recovered()
            except Exception as exc:
                self._failed(exc)
        return deleted

    async def announce(self, replica: str, info: ReplicaInfo, ttl_s: float) -> None:
        """Say this replica is alive for the next `ttl_s` seconds (a Redis key that expires)."""
        if self._usable():
            try:
                await self._redis.set(
                    self._replica_key(replica), orjson.dumps(asdict(info)), px=max(1, int(ttl_s * 1000))
                )
                self._recovered()
            except Exception as exc:
                self._failed(exc)

    async def replica(self, replica: str) -> ReplicaInfo | None:
        """The replica's last heartbeat, or None when it expired (or Redis cannot tell)."""
        if not self._usable():
            return None
        try:
            raw = await self._redis.get(self._replica_key(replica))
            self._recovered()
        except Exception as exc:
            self._failed(exc)
            return None
        try:
            return ReplicaInfo(**orjson.loads(raw)) if raw else None
        except (TypeError, ValueError):  # written by another version: as good as no heartbeat
            return None

    async def replicas(self) -> dict[str, ReplicaInfo]:
        """Every live heartbeat (their keys expire with the replica); {} when Redis cannot tell."""
        if not self._usable():
            return {}
        prefix = self._replica_key("")
        try:
            keys = [key async for key in self._redis.scan_iter(match=prefix + "*", count=100)]
            raws = await self._redis.mget(keys) if keys else []
            self._recovered()
        except Exception as exc:
            self._failed(exc)
            return {}
        out: dict[str, ReplicaInfo] = {}
        for key, raw in zip(keys, raws, strict=True):
            try:
                if raw:
                    out[key.decode()[len(prefix) :]] = ReplicaInfo(**orjson.loads(raw))
            except (TypeError, ValueError):  # written by another version: as good as no heartbeat
                continue
        return out

    async def withdraw(self, replica: str) -> None:
        if self._usable():
            try:
                await self._redis.delete(self._replica_key(replica))
                self._recovered()
            except Exception as exc:
                self._failed(exc)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._redis.aclose()

    def describe(self) -> dict:
        return {"kind": "redis", "connected": self._down_since is None}


def open_session_index(spec: str) -> SessionIndex:
    return MemorySessionIndex() if spec == "memory" else RedisSessionIndex(spec)


# Which replica/tier holds each session's KV: in memory, or Redis shared by replicas.
SESSION_INDEX: web.AppKey[SessionIndex] = web.AppKey("session_index")
