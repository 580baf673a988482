"""The store's side of its socket (wire.py), in vLLM's worker process next to the KV it serves.

vLLM's scheduler asks it how much of a prompt is stored, has it prefetch waiting requests' chunks, hands
it the queue (eviction order) and each scheduled turn's report; the worker side (worker.py) amends a
report whose load failed and records the keys a finished turn saved; attnstore's proxy reads a turn's
report (reused tokens per tier, for its headers) and saved keys (for its session index), forgets and
retains sessions, and reads the stats. The reports are kept for the last `max_turns` turns only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.schedule import Schedule
from kvtier.store import KVStore
from kvtier.tier_names import MEMORY_TIERS

from .wire import Handler

PUT_WAIT_S = 2.0  # a lookup waits this long at most for the saves in flight of its namespace


class StoreService:
    def __init__(self, store: KVStore, *, prefetch: bool = True, max_turns: int = 4096) -> None:
        self.store = store
        self.prefetch_enabled = prefetch
        self._max_turns = max_turns
        self._lock = threading.Condition()
        self._turns: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._puts: dict[str, int] = {}  # saves in flight per namespace
        self._forgotten: list[tuple[str, str]] = []  # (namespace, session), in the order forgotten
        self._request_keys: dict[str, list[str]] = {}  # vLLM request id -> its matched chunk keys

    def handlers(self) -> dict[str, Handler]:
        return {
            "lookup": self.lookup,
            "report": self.report,
            "turn": self.turn,
            "forget": self.forget,
            "retain": self.retain,
            "schedule": self.schedule,
            "stats": self.stats,
            "flush": self.flush,
        }

    # ---- the scheduler's questions -----------------------------------------------------------------

    def lookup(
        self,
        namespace: str,
        tokens: Sequence[int],
        count: bool = False,
        prefetch: bool = False,
        wait_s: float = 0.0,
        req: str | None = None,
        forgotten_since: int = 0,
        hints: Sequence[str] = (),
    ) -> dict[str, Any]:
        """The stored prefix of `tokens` as [start, n_tokens, tier] chunks. `count`: a turn's one counted
        lookup (a hit of its slowest tier, or a miss). `prefetch`: bring its disk chunks up to host memory
        in the background; `wait_s`: wait that long for prefetches first. Also returns the sessions
        forgotten since `forgotten_since` (the scheduler drops them from vLLM's own cache). `hints`: keys
        another replica stored for the session, adopted from the shared L2 first."""
        self._wait_puts(namespace)
        match = self.store.lookup(namespace, tokens, count=count, hint_keys=hints)
        on_disk = any(c.tier not in MEMORY_TIERS for c in match.chunks)
        if prefetch and on_disk and self.prefetch_enabled:
            self.store.prefetch(match)
        if wait_s > 0 and on_disk and self.prefetch_enabled and self.store.wait_prefetched(wait_s):
            match = self.store.lookup(namespace, tokens, count=False)
        if req is not None:
            with self._lock:
                self._request_keys[req] = [c.key for c in match.chunks]
        with self._lock:
            forgotten = self._forgotten[forgotten_since:]
            version = len(self._forgotten)
        return {
            "chunks": [[c.start, c.n_tokens, c.tier] for c in match.chunks],
            "prefetch_idle": self.store.wait_prefetched(0),
            "forgotten": forgotten,
            "forgotten_version": version,
        }

    def schedule(self, running: Sequence[str], queue: Sequence[str], window: int) -> None:
        """vLLM's running and waiting requests (head first) as the store's eviction order."""
        with self._lock:
            keys = self._request_keys
            for req in [r for r in keys if r not in set(running) | set(queue)]:
                del keys[req]  # finished or aborted
            sched = Schedule.from_queue(
                [keys.get(r, []) for r in running], [keys.get(r, []) for r in queue], window
            )
        self.store.set_schedule(sched)

    # ---- per-turn reports -----------------------------------------------------------------------------

    def report(self, turn: str, tiers: dict[str, int], prompt: int) -> None:
        """A scheduled turn: prompt tokens reused from each tier (l0: vLLM's own cache)."""
        with self._lock:
            entry = self._turns.setdefault(turn, {})
            entry.update(tiers=dict(tiers), prompt=prompt)
            self._turns.move_to_end(turn)
            while len(self._turns) > self._max_turns:
                self._turns.popitem(last=False)
            self._lock.notify_all()

    def load_failed(self, turn: str, tiers: Sequence[str]) -> None:
        """The worker could not restore the turn's KV from these tiers: vLLM recomputes those tokens."""
        with self._lock:
            report = self._turns.get(turn, {}).get("tiers")
            if report is not None:
                report.update(dict.fromkeys(tiers, 0))

    def saved(self, turn: str, keys: list[str]) -> None:
        with self._lock:
            self._turns.setdefault(turn, {})["keys"] = keys
            self._lock.notify_all()

    def turn(self, turn: str, wait_s: float = 0.0, saved: bool = False) -> dict[str, Any] | None:
        """The turn's report (waiting up to `wait_s` for it, or with `saved` for its saved keys too)."""

        def ready() -> bool:
            entry = self._turns.get(turn)
            return entry is not None and "tiers" in entry and (not saved or "keys" in entry)

        with self._lock:
            self._lock.wait_for(ready, wait_s)
            entry = self._turns.get(turn)
            return dict(entry) if entry is not None else None

    # ---- saves in flight --------------------------------------------------------------------------------

    def begin_put(self, namespace: str) -> None:
        with self._lock:
            self._puts[namespace] = self._puts.get(namespace, 0) + 1

    def end_put(self, namespace: str) -> None:
        with self._lock:
            self._puts[namespace] -= 1
            if not self._puts[namespace]:
                del self._puts[namespace]
            self._lock.notify_all()

    def _wait_puts(self, namespace: str) -> None:
        """A turn that follows right after its previous one finds that one's KV stored."""
        with self._lock:
            self._lock.wait_for(lambda: namespace not in self._puts, PUT_WAIT_S)

    # ---- the proxy's operations -----------------------------------------------------------------------

    def forget(self, namespace: str, session: str) -> int:
        self._wait_puts(namespace)  # a turn's save still in flight is forgotten too
        dropped = self.store.forget_session(namespace, session)
        with self._lock:
            self._forgotten.append((namespace, session))
        return dropped

    def retain(self, namespace: str, session: str, seconds: float) -> float:
        """Keep the session in the store's memory ahead of idle ones (kvtier/retention.py); the
        deadline, on the store's clock."""
        return self.store.retain(namespace, session, float(seconds))

    def stats(self) -> dict[str, Any]:
        return self.store.stats().to_dict()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Every save handed over so far is in the store and on disk (a restart finds it)."""
        with self._lock:
            self._lock.wait_for(lambda: not self._puts, timeout_s)
        self.store.flush(timeout_s)
