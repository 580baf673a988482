"""KVStore: the facade the runner uses. It answers lookups and takes puts itself, and hands the rest to
one part per idea, all sharing one StoreState (index, budgets, counters) under one lock:

    placement.py  which tier holds what, demotion and eviction   adoption.py  L2 files: scan, adopt by key
    saving.py     background L2 writes with back-pressure        loading.py   load and prefetch threads

The invariants (stated in state.py): no budget above capacity, pinned entries never evicted, an entry
leaves the index when no tier holds it; tensor copies and disk I/O happen outside the lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from .adoption import adopt_key, scan_folder
from .chunk import ChunkId, ChunkKV, host_bytes
from .chunk_keys import chain, chunk_spans, root_key
from .config import ChunkRef, PrefixMatch, StoreConfig
from .index import Entry, Step, longest_prefix
from .layout import KVLayout, normalize_layers
from .loading import Loading
from .placement import Copy
from .prefetch import Prefetching
from .restore import RestoredKV
from .saving import Saving
from .schedule import Schedule
from .state import StoreState
from .stats import StoreStats, TierStats
from .tiers import TIERS


class KVStore:
    def __init__(self, config: StoreConfig, layout: KVLayout, model_fingerprint: str) -> None:
        self.config = config
        self.layout = layout
        self.model_fingerprint = model_fingerprint
        config.l2_path.mkdir(mode=0o700, parents=True, exist_ok=True)  # owner only: see chunk_files
        self._s = StoreState(config, layout, model_fingerprint)
        self.device = self._s.device
        self._closed = False
        scan_folder(self._s)
        self._loading = Loading(self._s)
        self._prefetching = Prefetching(self._s, self._loading)
        self._saving = Saving(self._s)

    # ---- keys -------------------------------------------------------------------------------------

    def _root_key(self, namespace: str) -> str:
        return root_key(self.model_fingerprint, self.layout.describe(), namespace)

    def chain_keys(self, namespace: str, token_ids: Sequence[int]) -> list[str]:
        return chain(self._root_key(namespace), list(token_ids), self.config.chunk_tokens)

    def chain_tokens(self, namespace: str, keys: Sequence[str]) -> list[int]:
        """The token ids of a stored chain of chunk keys (a sequence as put() returned its keys), up to
        the first key that is missing, not this namespace's, or not the next link of the chain. Adopts
        files another replica wrote, as lookup() does with hint keys."""
        s = self._s
        tokens: list[int] = []
        parent = self._root_key(namespace)
        for key in keys:
            with s.lock:
                entry = s.index.get(key)
            if entry is None and adopt_key(s, key):
                with s.lock:
                    entry = s.index.get(key)
            chunk = entry.chunk if entry is not None and entry.usable else None
            if chunk is None or chunk.namespace != namespace or chunk.parent != parent:
                break
            tokens.extend(chunk.token_ids)
            parent = key
        return tokens

    # ---- lookup and pinning -------------------------------------------------------------------------

    def lookup(
        self,
        namespace: str,
        token_ids: Sequence[int],
        *,
        hint_keys: Sequence[str] = (),
        count: bool = True,
    ) -> PrefixMatch:
        """Longest stored prefix of token_ids for this namespace, adopting hinted/shared files first.
        `count=False`: a look-ahead (prefetch) that must not count as a hit or miss of its own."""
        token_ids = list(token_ids)
        s = self._s
        for key in hint_keys:
            with s.lock:
                known = s.index.get(key) is not None
            if not known:
                adopt_key(s, key)
        root, tried = self._root_key(namespace), set()
        missing: list[str] = []

        def find(key: str) -> Entry | None:
            entry = s.index.get(key)
            if entry is None and key not in tried:
                missing.append(key)
            return entry

        while True:
            missing.clear()
            with s.lock:
                steps = longest_prefix(s.index, root, namespace, token_ids, self.config.chunk_tokens, find)
                if not missing:
                    return self._finish_lookup(namespace, steps, count)
            tried.add(missing[0])
            adopt_key(s, missing[0])  # a file another replica may have written: one stat, outside the lock

    def _finish_lookup(self, namespace: str, steps: list[Step], count: bool) -> PrefixMatch:
        """With the lock held: the match, its chunks touched (recently used), and the hit counted."""
        chunks = tuple(ChunkRef(st.entry.key, st.start, st.n_tokens, st.entry.tier) for st in steps)
        match = PrefixMatch(namespace, sum(st.n_tokens for st in steps), chunks)
        c = self._s.counters
        for st in steps:
            self._s.placement.touch(st.entry)
            if count:
                c.chunk_hits[st.entry.tier] += 1
                c.reused_tokens[st.entry.tier] += st.n_tokens
                if st.entry.prefetched and st.entry.data is not None:
                    c.prefetch_used += 1
                st.entry.prefetched = False
        if count and match.tier is None:
            c.misses += 1
        elif count and match.tier is not None:
            c.hits[match.tier] += 1
        return match

    @contextlib.contextmanager
    def acquire(self, match: PrefixMatch) -> Iterator[None]:
        """Pin the match's chunks (never evicted, never superseded) while a job uses them."""
        s = self._s
        with s.lock:
            pinned = s.pin(e for e in (s.index.get(c.key) for c in match.chunks) if e is not None)
        try:
            yield
        finally:
            s.unpin(pinned)

    # ---- load and prefetch -------------------------------------------------------------------------

    def load(
        self,
        match: PrefixMatch,
        *,
        capacity: int | None = None,
        out: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> RestoredKV:
        """Start restoring the match's KV on a load thread; layer(i) of the result blocks per layer.
        `capacity`: tokens of room to allocate per layer (at least match.tokens), see RestoredKV.
        `out`: the caller's own per-layer (K, V) buffers, [1, heads, >= match.tokens, head_dim] each,
        to restore into instead (nothing is allocated); they must stay untouched until the result is
        `ready` (a failed or cancelled job waits for that before it reuses them)."""
        return self._loading.load(match, capacity, out)

    def prefetch(self, match: PrefixMatch) -> None:
        """Bring the match's chunks up in the background (disk to host, into L0 where it has room without
        evicting what the schedule protects): the scheduler's look-ahead. Never raises."""
        self._prefetching.prefetch(match)

    def shed_memory(self, nbytes: int) -> int:
        """The machine runs short of memory: free up to `nbytes` of L1 then L0 by dropping the memory
        copies of chunks that are safe in L2 (pinned and schedule-protected chunks stay). Returns bytes
        freed (their tensors go as soon as no load is reading them)."""
        with self._s.lock:
            return self._s.placement.shed(nbytes)

    def shed_device_memory(self) -> int:
        """The device ran out of memory: move every evictable L0 chunk to L1 (or drop its memory copy
        when L1 has no room and it is on disk). Returns the bytes that left L0."""
        s = self._s
        copies: list[Copy] = []
        with s.lock:
            freed = s.placement.demote_all("l0", copies)
        s.move(copies)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Block until every prefetch asked for so far has run (False if the timeout passed first)."""
        return self._prefetching.wait_idle(timeout)

    def set_schedule(self, schedule: Schedule | None) -> None:
        """The runner's queue as eviction sees it (schedule.py); None: plain LRU with pins."""
        with self._s.lock:
            self._s.placement.schedule = schedule

    # ---- put ---------------------------------------------------------------------------------------

    def put(
        self,
        namespace: str,
        token_ids: Sequence[int],
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        session: str | None = None,
    ) -> list[str]:
        """Store the chunks of token_ids not stored yet (copies them); returns the keys covering token_ids.

        For a final partial chunk already covered by a longer stored sibling, the sibling's key is returned.
        """
        token_ids = list(token_ids)
        if not token_ids:
            return []
        pairs = normalize_layers(layers, self.layout, len(token_ids))
        spans = chunk_spans(len(token_ids), self.config.chunk_tokens)
        keys = self.chain_keys(namespace, token_ids)
        parents = [self._root_key(namespace), *keys[:-1]]
        chunks = [
            ChunkId(keys[i], namespace, parents[i], tuple(token_ids[s:e]), session)
            for i, (s, e) in enumerate(spans)
        ]
        result = list(keys)
        s = self._s
        with s.lock:
            todo = [i for i, c in enumerate(chunks) if not self._have(c, result, i)]
        if not todo:
            return result
        data = copy_chunks(pairs, {i: spans[i] for i in todo}, self.layout, self.device)  # no lock held
        saves: list[Entry] = []
        deletes: list[Path] = []
        copies: list[Copy] = []
        with s.lock:
            for i in todo:
                if self._have(chunks[i], result, i):
                    continue  # another thread stored it meanwhile
                entry = Entry(chunks[i], s.nbytes(chunks[i].n_tokens))
                s.index.add(entry)
                self._drop_superseded(entry, deletes)
                s.placement.place(entry, data[i], copies, s.keep_tiers)
                if self._saving.reserve(entry, data[i], deletes):
                    saves.append(entry)
                if not entry.usable:  # fits nowhere (everything pinned, or tiers disabled)
                    s.index.remove(entry.key)
        s.move(copies)
        s.unlink(deletes)
        self._saving.submit(saves)  # blocks when the save queue is full: back-pressure
        return result

    def _have(self, chunk: ChunkId, result: list[str], i: int) -> bool:
        """With the lock held: is this chunk stored already? A partial chunk counts as stored when a
        longer stored sibling covers it (its key then replaces result[i])."""
        entry = self._s.index.get(chunk.key)
        if entry is not None and entry.usable and entry.chunk.token_ids == chunk.token_ids:
            return True
        toks = chunk.token_ids
        if len(toks) < self.config.chunk_tokens:
            for sib in self._s.index.children(chunk.parent):
                if sib.usable and sib.n_tokens > len(toks) and sib.chunk.token_ids[: len(toks)] == toks:
                    result[i] = sib.key
                    return True
        return False

    def _drop_superseded(self, entry: Entry, deletes: list[Path]) -> None:
        """With the lock held: a partial sibling whose tokens are a strict prefix of the new chunk's is
        now redundant."""
        for sib in self._s.index.children(entry.chunk.parent):
            if (
                sib is not entry
                and sib.pins == 0
                and sib.n_tokens < entry.n_tokens
                and entry.chunk.token_ids[: sib.n_tokens] == sib.chunk.token_ids
            ):
                deletes.extend(self._s.placement.remove(sib))

    # ---- forget, stats, lifecycle ------------------------------------------------------------------

    def _forget(self, pred: Callable[[ChunkId], bool]) -> int:
        deletes: list[Path] = []
        with self._s.lock:
            victims = [e for e in self._s.index.entries() if pred(e.chunk)]
            for e in victims:
                deletes.extend(self._s.placement.remove(e))
        self._s.unlink(deletes)
        return len(victims)

    def forget_session(self, namespace: str, session: str) -> int:
        """Drop the chunks this session stored (first writer wins the tag) from every tier."""
        return self._forget(lambda c: c.namespace == namespace and c.session == session)

    def forget_namespace(self, namespace: str) -> int:
        return self._forget(lambda c: c.namespace == namespace)

    def stats(self) -> StoreStats:
        with self._s.lock:
            b, c = self._s.placement.budgets, self._s.counters
            return StoreStats(
                tiers={t: TierStats(b[t].used, b[t].capacity, len(b[t])) for t in TIERS},
                hits=dict(c.hits),
                chunk_hits=dict(c.chunk_hits),
                misses=c.misses,
                evictions=sum(b[t].evictions for t in TIERS),
                evictions_by_tier={t: b[t].evictions for t in TIERS},
                bytes_loaded=c.bytes_loaded,
                bytes_saved=c.bytes_saved,
                saves_pending=self._saving.pending,
                save_errors=c.save_errors,
                saving_enabled=self._saving.enabled,
                load_errors=c.load_errors,
                quarantined=c.quarantined,
                reused_tokens=dict(c.reused_tokens),
                prefetch_issued=c.prefetch_issued,
                prefetch_completed=c.prefetch_completed,
                prefetch_used=c.prefetch_used,
                prefetch_wasted=c.prefetch_wasted,
            )

    def flush(self, timeout: float | None = None) -> None:
        """Wait until no save is pending (or the timeout passes)."""
        self._saving.flush(timeout)

    def close(self) -> None:
        """Wait for loads, prefetches and saves in flight, then stop their threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._prefetching.close()
        self._loading.close()
        self._saving.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def copy_chunks(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    spans: dict[int, tuple[int, int]],
    layout: KVLayout,
    device: torch.device,
) -> dict[int, ChunkKV]:
    """The caller's K/V sliced into chunk buffers on `device`: one allocation per chunk, then every
    layer's K and V slice copied in, layer by layer (each source tensor is read once, front to back)."""
    chunks = {i: ChunkKV.empty(layout, e - s, device) for i, (s, e) in spans.items()}
    dst_bytes = {i: c.host_bytes() for i, c in chunks.items()}
    for li, (k, v) in enumerate(pairs):
        for kv, src in enumerate((k, v)):
            src_bytes = host_bytes(src)
            for i, (s, e) in spans.items():
                dst = dst_bytes[i]
                if src_bytes is not None and dst is not None:
                    np.copyto(dst[li, kv], src_bytes[:, s:e])
                else:
                    chunks[i].buf[li, kv].copy_(src[:, s:e])
    return chunks


__all__ = ["KVStore"]
