"""KV-aware forwarding between replicas: a turn goes to the replica that holds its KV hot.

Every replica with `proxy.advertise_url` and a shared (Redis) session index announces its address and load
(jobs queued or running) with a heartbeat that expires after three missed beats. A replica that receives a
local turn whose session another live replica holds in L0/L1 (the session index says which replica and
tier) forwards it there, unless that replica's load exceeds its own by more than
`proxy.forward_max_queue_gap`: then it serves the turn itself from the shared L2 (an `l2_hit`), as
NVIDIA Dynamo's KV router weighs overlap against load.

- One hop at most: a forwarded request carries `X-AttentionStore-Forwarded-By`, and a request carrying it
  is always served where it lands (the balancer removes the header from clients' requests).
- As-is: the client's headers (its key included: the owner authenticates it and derives the same tenant)
  and body (the session field included) go to the owner; the owner's status, headers (its
  `X-AttentionStore-Replica`) and body come back chunk by chunk. `X-AttentionStore-TTFT-Ms` is the
  owner's plus the time the turn spent here before it left.
- Never a failed request for a dead or slow owner: a connect that fails or takes longer than
  `proxy.forward_connect_timeout_s`, a connection lost before the owner's answer began, or a 503 (the
  owner's queue is full) costs that one attempt, and the turn is served here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from urllib.parse import quote

import aiohttp
from aiohttp import web

from kvtier.tier_names import MEMORY_TIERS  # torch-free: the tier names only

from ..metrics import METRICS
from ..openai.requests import ApiRequest
from ..settings import Settings, replica_id
from ..turns.headers import FORWARDED_BY
from ..turns.local_start import LOCAL_START, local_engine
from ..turns.turn import Turn
from ..upstream.forward import HTTP_CLIENT
from ..upstream.header_filter import inbound_headers, outbound_headers
from .session_index import ReplicaInfo, SessionIndex, SessionRecord

log = logging.getLogger("attnstore.forwarding")
# A replica is taken for dead once it missed this many heartbeats.
MISSED_BEATS = 3


def forward_target(
    record: SessionRecord | None,
    owner: ReplicaInfo | None,
    *,
    me: str,
    own_load: int,
    max_gap: int,
) -> str | None:
    """The owner's URL when the turn should go there, else None (serve it here)."""
    if record is None or record.replica == me or record.tier not in MEMORY_TIERS:
        return None
    if owner is None or not owner.url:  # no heartbeat: dead, gone, or Redis cannot tell
        return None
    if owner.load - own_load > max_gap:  # much busier than this one: the shared L2 is faster
        return None
    return owner.url.rstrip("/")


class Forwarder:
    def __init__(
        self,
        settings: Settings,
        index: SessionIndex,
        load: Callable[[], int],
        on_outcome: Callable[[str], None] = lambda outcome: None,
    ):
        p = settings.proxy
        self.on_outcome = on_outcome  # "forwarded" | "served_here", once per attempt
        self.settings = settings
        self.me = replica_id(settings)
        self.url = p.advertise_url.rstrip("/")
        self.index = index
        self.load = load
        self.max_gap = p.forward_max_queue_gap
        self.interval_s = p.heartbeat_s
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=p.forward_connect_timeout_s, sock_read=p.upstream_timeout_s
        )

    # -- the heartbeat ------------------------------------------------------------------------------

    async def beat(self) -> None:
        await self.index.announce(
            self.me, ReplicaInfo(url=self.url, load=self.load()), self.interval_s * MISSED_BEATS
        )

    async def heartbeat(self, app: web.Application) -> AsyncIterator[None]:
        """cleanup_ctx: announce this replica while the app runs, from the moment its local serving has
        started (a replica still starting would be sent the turns of sessions its index records name
        it for, and hold them for the whole start); withdraw it when the app stops."""

        async def loop() -> None:
            await app[LOCAL_START].wait()
            while True:
                try:
                    await self.beat()
                except Exception:  # the index swallows Redis errors; anything else must not stop beating
                    log.exception("heartbeat failed")
                await asyncio.sleep(self.interval_s)

        task = asyncio.create_task(loop(), name="attnstore-heartbeat")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self.index.withdraw(self.me)

    # -- one turn -------------------------------------------------------------------------------------

    async def try_forward(
        self, request: web.Request, chat: ApiRequest, turn: Turn
    ) -> web.StreamResponse | None:
        """The owner's answer when this turn belongs there, else None (serve it here)."""
        if FORWARDED_BY in request.headers:
            return None  # one hop at most
        record = await self.index.get(turn.tenant, turn.session)
        if record is None or record.replica == self.me or record.tier not in MEMORY_TIERS:
            return None
        owner = await self.index.replica(record.replica)
        url = forward_target(record, owner, me=self.me, own_load=self.load(), max_gap=self.max_gap)
        if url is None:
            return None
        response = await self._forward(request, chat, turn, url + request.raw_path, record.replica)
        if response is None:
            self.on_outcome("served_here")
        return response

    async def _forward(
        self, request: web.Request, chat: ApiRequest, turn: Turn, url: str, owner: str
    ) -> web.StreamResponse | None:
        http = request.app[HTTP_CLIENT]
        sent_at = time.monotonic()
        try:
            headers = outbound_headers(request.headers, self.settings, "replica")
            resp = await http.post(url, data=chat.raw, headers=headers, timeout=self.timeout)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.warning(
                "session=%s: replica %s did not take the turn (%s); serving it here",
                turn.session,
                owner,
                type(exc).__name__,
            )
            return None
        try:
            if resp.status == 503:  # the owner's queue is full: this replica can still serve it
                log.info("session=%s: replica %s is full; serving the turn here", turn.session, owner)
                return None
            try:
                first = await resp.content.readany()
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                log.warning(
                    "session=%s: replica %s failed before answering (%s); serving the turn here",
                    turn.session,
                    owner,
                    type(exc).__name__,
                )
                return None
            answer_headers = inbound_headers(resp.headers)
            turn.forwarded(answer_headers, sent_at)
            log.debug("session=%s turn=%d forwarded to %s", turn.session, turn.turn, owner)
            out = web.StreamResponse(status=resp.status, reason=resp.reason, headers=answer_headers)
            await out.prepare(request)
            self.on_outcome("forwarded")  # counted before the client can see the answer
            if first:
                await out.write(first)
            try:
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
            except (asyncio.TimeoutError, aiohttp.ClientError):
                # The owner died mid-answer; the headers are gone already: cut the client's stream too.
                resp.close()
                if request.transport is not None:
                    request.transport.close()
                return out
            await out.write_eof()
            return out
        except BaseException:
            resp.close()  # the client went away: the owner's job is cancelled with the connection
            raise
        finally:
            resp.release()

    # -- forgetting a session on every replica --------------------------------------------------------

    async def forget_elsewhere(self, request: web.Request, session: str) -> tuple[bool, int]:
        """The caller's DELETE of a session (or of a stored response: its session is its id) sent on to
        every other live replica as a session DELETE (each holds its own L0 and L1 copies, and indexes
        the L2 files it wrote), at once: (whether any of them had the session, the chunks they
        dropped). A replica that does not answer costs nothing but its part: its memory goes with it,
        and the session index has forgotten the session already."""
        if FORWARDED_BY in request.headers:
            return False, 0  # sent here by a replica that asks the others itself
        others = [
            info.url.rstrip("/")
            for name, info in (await self.index.replicas()).items()
            if name != self.me and info.url
        ]
        if not others:
            return False, 0
        http = request.app[HTTP_CLIENT]
        headers = outbound_headers(request.headers, self.settings, "replica")
        path = SESSION_PATH.format(quote(session, safe=""))

        async def forget(url: str) -> tuple[bool, int]:
            try:
                async with http.delete(url + path, headers=headers, timeout=self.timeout) as resp:
                    body = await resp.json(content_type=None) if resp.status == 200 else {}
                if not isinstance(body, dict):  # not this API's answer: as good as none
                    return False, 0
                return bool(body.get("deleted")), int(body.get("chunks") or 0)
            except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError, TypeError) as exc:
                log.warning("replica at %s did not forget the session (%s)", url, type(exc).__name__)
                return False, 0

        answers = await asyncio.gather(*(forget(url) for url in others))
        return any(d for d, _ in answers), sum(n for _, n in answers)


FORWARDER = web.AppKey("forwarder", Forwarder)
# Where a replica forgets a session of the caller's tenant (proxy/http/routes_store.py serves it).
SESSION_PATH = "/v1/attention_store/sessions/{}"


def install_forwarding(app: web.Application, settings: Settings, index: SessionIndex) -> Forwarder | None:
    """Turn on the heartbeat and forwarding when this replica has an address and a shared index."""
    if not (settings.proxy.advertise_url and index.shared):
        return None

    def load() -> int:
        engine = local_engine(app)
        return engine.load() if engine is not None else 0

    forwarded = app[METRICS].forwarded
    forwarder = Forwarder(settings, index, load, lambda outcome: forwarded.labels(outcome).inc())
    app[FORWARDER] = forwarder
    app.cleanup_ctx.append(forwarder.heartbeat)
    return forwarder
