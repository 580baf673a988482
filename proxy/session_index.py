"""The session index: which replica and tier last held each session's KV chunks, and their keys, and
which replicas are alive (each announces its address and load with a heartbeat that expires).

Replicas that share one L2 folder learn each other's chunk keys here, so a turn that lands on another
replica still finds the conversation's KV on disk (an `l2_hit`). The in-memory index is the embedded
default; Redis shares it across replicas. Redis is a helper, never a dependency of a request: when it
fails, the index answers from its local copy, logs one warning, and uses Redis again once it answers.
Replicas are known through Redis only: without it (or while it is down) no replica knows another, and
every turn is served where it lands.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

import orjson

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
    async def announce(self, replica: str, info: ReplicaInfo, ttl_s: float) -> None: ...
    async def replica(self, replica: str) -> ReplicaInfo | None: ...
    async def withdraw(self, replica: str) -> None: ...
    async def close(self) -> None: ...
    def describe(self) -> dict: ...


class MemorySessionIndex:
    """A dict, bounded so that a flood of one-turn sessions cannot grow it without end."""

    shared = False

    def __init__(self, max_sessions: int = 100_000):
        self._records: dict[tuple[str, str], SessionRecord] = {}
        self._max = max_sessions

    async def get(self, tenant: str, session: str) -> SessionRecord | None:
        return self._records.get((tenant, session))

    async def put(self, tenant: str, session: str, record: SessionRecord) -> None:
        self._records.pop((tenant, session), None)
        self._records[(tenant, session)] = record
        while len(self._records) > self._max:
            self._records.pop(next(iter(self._records)))

    async def forget(self, tenant: str, session: str) -> None:
        self._records.pop((tenant, session), None)

    # One process, no other replica to know of.
    async def announce(self, replica: str, info: ReplicaInfo, ttl_s: float) -> None:
        pass

    async def replica(self, replica: str) -> ReplicaInfo | None:
        return None

    async def withdraw(self, replica: str) -> None:
        pass

    async def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"kind": "memory", "sessions": len(self._records)}


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
