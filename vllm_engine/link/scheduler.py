"""The connector's scheduler side: how many prompt tokens the store supplies, the queue as the store's
hint, and what the worker loads and saves each step. Plain data in and out (vllm_engine/connector.py
reads vLLM's objects), and the store reached through its socket (wire.py), so it runs in vLLM's
scheduler process.

A request's life here:

- arrives (`arrived`): one counted lookup (a hit of the slowest tier, or a miss), remembered as the tiers
  the turn had to reach; inside the look-ahead window its disk chunks start coming up to host memory.
- is considered for scheduling (`matched_tokens`): the stored prefix beyond vLLM's own cache. While a
  chunk it needs is still only on disk and its prefetch is running, the answer is "not yet" (None): vLLM
  schedules other requests meanwhile, so no step waits on the disk (after `max_prefetch_wait_s`, or when
  host memory cannot take the chunks, it is loaded from disk during the step, layer by layer).
- is scheduled (`allocated`, `plan_step`): its load goes to the worker with its blocks, and its report
  (reused tokens per tier; l0 is vLLM's own cache) to the store, where the proxy reads it.
- finishes (`finished`): its computed tokens are saved from its blocks, which vLLM holds until the worker
  has copied them (one step).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.tier_names import MEMORY_TIERS, TIERS

from .plan import (
    VLLM_TIER,
    LoadSpec,
    SaveSpec,
    StepPlan,
    StoredChunk,
    TurnParams,
    external_tokens,
    first_seen_tiers,
    tokens_by_tier,
)
from .wire import StoreClient, StoreError, StoreUnavailable

log = logging.getLogger(__name__)
MAX_SESSIONS_TRACKED = 4096  # sessions whose cached vLLM blocks a forget can still find


@dataclass
class _Request:
    params: TurnParams
    prompt: tuple[int, ...]
    first_seen: list[StoredChunk] = field(default_factory=list)
    prefetch_at: float | None = None  # when its prefetch was asked for
    chunks: list[StoredChunk] = field(default_factory=list)  # the match its load was planned from
    load: tuple[int, int] = (0, 0)  # [start, end) restored from the store


class SchedulerSide:
    def __init__(
        self,
        client: StoreClient,
        *,
        block_size: int,
        lookahead: int = 1,
        prefetch: bool = True,
        scheduler_aware: bool = True,
        save: bool = True,
        max_prefetch_wait_s: float = 5.0,
    ) -> None:
        self.client = client
        self.block_size = block_size
        self.lookahead = lookahead
        self.prefetch = prefetch
        self.scheduler_aware = scheduler_aware
        self.save = save
        self.max_prefetch_wait_s = max_prefetch_wait_s
        self._requests: dict[str, _Request] = {}
        self._waiting: list[str] = []  # arrived, not scheduled yet (arrival order)
        self._running: list[str] = []
        self._loads: dict[str, LoadSpec] = {}
        self._saves: list[SaveSpec] = []
        self._sessions: OrderedDict[tuple[str, str], list[tuple[int, Any]]] = OrderedDict()
        self._forgotten_seen = 0
        self._block_pool: Any = None
        self._warned = False

    def bind_block_pool(self, block_pool: Any) -> None:
        """vLLM's block pool, to drop a forgotten session's blocks from vLLM's own prefix cache."""
        self._block_pool = block_pool

    # ---- a request's life -----------------------------------------------------------------------------

    def arrived(self, req_id: str, prompt: Sequence[int], params: TurnParams) -> None:
        r = self._requests[req_id] = _Request(params, tuple(prompt))
        self._waiting.append(req_id)
        if params.reuse:
            in_window = len(self._waiting) <= self.lookahead
            prefetch = self.prefetch and in_window
            reply = self._lookup(r, req_id, count=True, prefetch=prefetch, hints=list(params.hints))
            r.first_seen = _chunks(reply)
            if self.prefetch and in_window:
                r.prefetch_at = time.monotonic()
        else:
            self._lookup(r, req_id, count=False)  # sessions forgotten meanwhile still leave vLLM's cache
        self._send_schedule()

    def matched_tokens(self, req_id: str, local: int) -> int | None:
        """Tokens beyond vLLM's `local` hit that the store restores; None: ask again next step."""
        r = self._requests.get(req_id)
        if r is None or not r.params.reuse:
            return 0
        idle = not self._running
        reply = self._lookup(r, req_id, wait_s=0.05 if idle and r.prefetch_at is not None else 0.0)
        chunks = _chunks(reply)
        n = external_tokens(chunks[-1].end if chunks else 0, len(r.prompt), local)
        needed = [c for c in chunks if c.end > local and c.start < local + n]
        if n and self.prefetch and any(c.tier not in MEMORY_TIERS for c in needed):
            if r.prefetch_at is None:
                self._lookup(r, req_id, prefetch=True)
                r.prefetch_at = time.monotonic()
                return None
            waited = time.monotonic() - r.prefetch_at
            if not reply.get("prefetch_idle", True) and waited < self.max_prefetch_wait_s:
                return None
        r.chunks, r.load = chunks, (local, local + n)
        return n

    def allocated(self, req_id: str, block_ids: Sequence[int], n_external: int) -> None:
        """vLLM gave the request its blocks and will load `n_external` tokens after its local hit."""
        r = self._requests.get(req_id)
        if r is None or n_external <= 0:
            return
        start = r.load[0]
        end = start + n_external
        r.load = (start, end)
        self._loads[req_id] = LoadSpec(
            req_id, r.params.namespace, r.prompt[:end], start, end, tuple(block_ids), r.params.turn
        )

    def plan_step(self, new: Sequence[tuple[str, int]], resumed: Sequence[str]) -> StepPlan:
        """The worker's work for this step. `new`: (request id, its computed tokens: local + loaded) of
        requests scheduled for the first time; `resumed`: others scheduled again after a preemption."""
        plan = StepPlan(saves=self._saves)
        self._saves = []
        for req_id in [*(r for r, _ in new), *resumed]:
            load = self._loads.pop(req_id, None)
            if load is not None:
                plan.loads.append(load)
        for req_id, computed in new:
            r = self._requests.get(req_id)
            if r is None:
                continue
            if req_id in self._waiting:
                self._waiting.remove(req_id)
                self._running.append(req_id)
            if r.params.turn is not None:
                self._report(r, computed)
        if new:
            self._prefetch_window()
            self._send_schedule()
        return plan

    def finished(
        self, req_id: str, token_ids: Sequence[int], block_ids: Sequence[int], hashes: Sequence[Any]
    ) -> bool:
        """The request is done; True: vLLM must hold its blocks until the worker has copied its KV."""
        r = self._requests.pop(req_id, None)
        self._loads.pop(req_id, None)
        for queue in (self._waiting, self._running):
            if req_id in queue:
                queue.remove(req_id)
        if r is None:
            return False
        if r.params.session is not None:
            key = (r.params.namespace, r.params.session)
            self._sessions.setdefault(key, []).extend(zip(block_ids, hashes, strict=False))
            self._sessions.move_to_end(key)
            while len(self._sessions) > MAX_SESSIONS_TRACKED:
                self._sessions.popitem(last=False)
        if not self.save or not token_ids:
            return False
        n_blocks = -(-len(token_ids) // self.block_size)
        p = r.params
        self._saves.append(
            SaveSpec(req_id, p.namespace, tuple(token_ids), tuple(block_ids[:n_blocks]), p.session, p.turn)
        )
        return True

    # ---- the store ----------------------------------------------------------------------------------------

    def _lookup(self, r: _Request, req_id: str, **args: Any) -> dict[str, Any]:
        try:
            reply = self.client.call(
                "lookup",
                namespace=r.params.namespace,
                tokens=r.prompt,
                req=req_id,
                forgotten_since=self._forgotten_seen,
                **args,
            )
        except (StoreUnavailable, StoreError) as exc:
            self._warn(exc)
            return {"chunks": []}
        self._forget_in_vllm(reply.get("forgotten", []), reply.get("forgotten_version", self._forgotten_seen))
        return dict(reply)

    def _report(self, r: _Request, computed: int) -> None:
        start, end = r.load
        tiers: dict[str, int] = dict.fromkeys(TIERS, 0)
        tiers.update(tokens_by_tier(first_seen_tiers(r.first_seen, r.chunks), start, end))
        tiers[VLLM_TIER] += computed - (end - start)
        self._call("report", turn=r.params.turn, tiers=tiers, prompt=len(r.prompt))

    def _prefetch_window(self) -> None:
        """The head of the queue comes up to host memory before its turn (AttentionStore's look-ahead)."""
        if not self.prefetch:
            return
        for req_id in self._waiting[: self.lookahead]:
            r = self._requests[req_id]
            if r.params.reuse and r.prefetch_at is None:
                self._lookup(r, req_id, prefetch=True)
                r.prefetch_at = time.monotonic()

    def _send_schedule(self) -> None:
        if self.scheduler_aware:
            self._call("schedule", running=self._running, queue=self._waiting, window=self.lookahead)

    def _call(self, op: str, **args: Any) -> None:
        try:
            self.client.call(op, **args)
        except (StoreUnavailable, StoreError) as exc:
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("attnstore: the store did not answer, serving without it: %s", exc)

    def _forget_in_vllm(self, forgotten: list[list[str]], version: int) -> None:
        """Sessions forgotten in the store leave vLLM's prefix cache too (blocks still holding them)."""
        self._forgotten_seen = version
        if self._block_pool is None:
            return
        for namespace, session in forgotten:
            held = self._sessions.pop((namespace, session), [])
            blocks = self._block_pool.blocks
            stale = {b for b, h in held if h is not None and blocks[b].block_hash == h}
            if stale:
                self._block_pool.evict_blocks(stale)


def _chunks(reply: dict[str, Any]) -> list[StoredChunk]:
    return [StoredChunk(int(s), int(n), str(t)) for s, n, t in reply.get("chunks", [])]
