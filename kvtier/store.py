"""KVStore: the facade the runner uses. Owns the lock, the index, the tier budgets and the background
saver/loaders, and decides what placement, demotion and eviction mean.

Invariants (all under self._lock): every entry in a budget is in the index; an entry leaves the index
when no tier (nor a save in flight) holds its bytes; no budget is ever above capacity; entries with
pins > 0 are never evicted. Disk I/O (reads, writes, unlinks, quarantine) happens outside the lock.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .config import ChunkRef, PrefixMatch, StoreConfig
from .disk import (
    ChunkMeta,
    CorruptChunk,
    ForeignChunk,
    chunk_path,
    quarantine,
    read_chunk,
    read_header,
    scan,
    write_chunk,
    write_chunks,
)
from .index import Entry, PrefixIndex, Step, longest_prefix
from .keys import chain, chunk_spans, root_key
from .layout import KVLayout, normalize_layers
from .loader import KVLoadError, LoadFailure, PlanItem, RestoredKV, run_load
from .saver import SavePool
from .stats import Counters, StoreStats, TierStats
from .tiers import MEMORY_TIERS, TIERS, ChunkKV, Tier, TierBudget, host_bytes

log = logging.getLogger(__name__)


class KVStore:
    def __init__(self, config: StoreConfig, layout: KVLayout, model_fingerprint: str) -> None:
        self.config = config
        self.layout = layout
        self.model_fingerprint = model_fingerprint
        self.device = torch.device(config.device)
        self._host = torch.device("cpu")
        self._pin_host = self.device.type == "cuda"
        self._root = config.l2_path
        self._root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._index = PrefixIndex()
        self._budgets = {
            "l0": TierBudget("l0", config.l0_capacity_bytes),
            "l1": TierBudget("l1", config.l1_capacity_bytes),
            "l2": TierBudget("l2", config.l2_capacity_bytes),
        }
        self._c = Counters()
        self._pending = 0
        self._saving_enabled = True
        self._closed = False
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-prefetch")
        self._scan()
        self._saver: SavePool[Entry] | None = (
            SavePool(config.save_workers, config.save_queue_chunks, self._save_entry)
            if config.async_save
            else None
        )

    # ---- keys -------------------------------------------------------------------------------------

    def _root_key(self, namespace: str) -> str:
        return root_key(self.model_fingerprint, self.layout.describe(), namespace)

    def chain_keys(self, namespace: str, token_ids: Sequence[int]) -> list[str]:
        return chain(self._root_key(namespace), list(token_ids), self.config.chunk_tokens)

    def _nbytes(self, n_tokens: int) -> int:
        return n_tokens * self.layout.bytes_per_token

    # ---- start-up and adoption of files -----------------------------------------------------------

    def _scan(self) -> None:
        for path, _mtime in scan(self._root):  # oldest first, so LRU order follows file age
            meta = self._read_meta(path)
            if meta is not None:
                self._unlink(self._adopt(meta))

    def _read_meta(self, path: Path) -> ChunkMeta | None:
        """Header of a file, or None (foreign, missing, or quarantined because it is bad)."""
        try:
            return read_header(path, self.model_fingerprint, self.layout)
        except ForeignChunk:
            return None
        except FileNotFoundError:
            return None
        except CorruptChunk as e:
            self._quarantine(path, str(e))
            return None

    def _quarantine(self, path: Path, reason: str) -> None:
        quarantine(self._root, path, reason)
        with self._lock:
            self._c.quarantined += 1

    def _adopt(self, meta: ChunkMeta) -> list[Path]:
        """Index a valid file (ours from before a restart, or another replica's). Returns files to delete."""
        deletes: list[Path] = []
        with self._lock:
            entry = self._index.get(meta.key)
            if entry is not None and (entry.on_disk or entry.pending is not None):
                return deletes
            if entry is None:
                entry = Entry(
                    meta.key,
                    meta.namespace,
                    meta.parent,
                    meta.token_ids,
                    meta.session,
                    self._nbytes(meta.n_tokens),
                )
            if not self._reserve_l2(entry, deletes):
                return deletes
            entry.on_disk, entry.meta = True, meta
            if self._index.get(meta.key) is None:
                self._index.add(entry)
        return deletes

    def _try_adopt_key(self, key: str) -> bool:
        path = chunk_path(self._root, key)
        if not path.exists():
            return False
        meta = self._read_meta(path)
        if meta is None:
            return False
        self._unlink(self._adopt(meta))
        with self._lock:
            entry = self._index.get(key)
            return entry is not None and entry.usable

    # ---- placement and eviction (call with the lock held) -----------------------------------------

    def _evictable(self, tier: Tier) -> Callable[[str], bool]:
        def ok(key: str) -> bool:
            e = self._index.get(key)
            return e is not None and e.pins == 0 and (tier != "l2" or e.pending is None)

        return ok

    def _place(self, entry: Entry, data: ChunkKV, tiers: Sequence[Tier] = MEMORY_TIERS) -> bool:
        """Put `data` in the first of `tiers` where it fits (demoting LRU victims); False if none."""
        for name in tiers:
            budget = self._budgets[name]
            if entry.mem_tier == name:
                budget.touch(entry.key)
                return True
            victims = budget.victims(entry.nbytes, self._evictable(name))
            if victims is None:
                continue
            for key in victims:
                self._evict_mem(name, key)
            if entry.mem_tier is not None:
                self._budgets[entry.mem_tier].remove(entry.key)
            budget.add(entry.key, entry.nbytes)
            target = self.device if name == "l0" else self._host
            entry.data = data.to(target, pin=self._pin_host and name == "l1")
            entry.mem_tier = name
            return True
        return False

    def _evict_mem(self, tier: Tier, key: str) -> None:
        entry = self._index.get(key)
        budget = self._budgets[tier]
        budget.remove(key)
        budget.evictions += 1
        assert entry is not None
        data, entry.data, entry.mem_tier = entry.data, None, None
        if tier == "l0" and data is not None and self._place(entry, data, ("l1",)):
            return
        if not entry.usable:
            self._index.remove(key)

    def _reserve_l2(self, entry: Entry, deletes: list[Path]) -> bool:
        budget = self._budgets["l2"]
        victims = budget.victims(entry.nbytes, self._evictable("l2"))
        if victims is None:
            return False
        for key in victims:
            victim = self._index.get(key)
            assert victim is not None
            budget.remove(key)
            budget.evictions += 1
            victim.on_disk, victim.meta = False, None
            deletes.append(chunk_path(self._root, key))
            if not victim.usable:
                self._index.remove(key)
        budget.add(entry.key, entry.nbytes)
        return True

    def _remove(self, entry: Entry) -> list[Path]:
        """Drop an entry from every tier; returns its file to delete (a save in flight deletes its own)."""
        for budget in self._budgets.values():
            budget.remove(entry.key)
        self._index.remove(entry.key)
        entry.data, entry.mem_tier = None, None
        paths = [chunk_path(self._root, entry.key)] if entry.on_disk else []
        entry.on_disk = False
        return paths

    def _touch(self, entry: Entry) -> None:
        for budget in self._budgets.values():
            budget.touch(entry.key)

    @staticmethod
    def _unlink(paths: Sequence[Path]) -> None:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    # ---- lookup, pinning ---------------------------------------------------------------------------

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
        for key in hint_keys:
            with self._lock:
                known = self._index.get(key) is not None
            if not known:
                self._try_adopt_key(key)
        root, tried = self._root_key(namespace), set()
        missing: list[str] = []

        def find(key: str) -> Entry | None:
            entry = self._index.get(key)
            if entry is None and key not in tried:
                missing.append(key)
            return entry

        while True:
            missing.clear()
            with self._lock:
                steps = longest_prefix(
                    self._index, root, namespace, token_ids, self.config.chunk_tokens, find
                )
                if not missing:
                    return self._finish_lookup(namespace, steps, count)
            tried.add(missing[0])
            self._try_adopt_key(missing[0])  # a file another replica may have written: one stat

    def _finish_lookup(self, namespace: str, steps: list[Step], count: bool) -> PrefixMatch:
        chunks = tuple(ChunkRef(s.entry.key, s.start, s.n_tokens, s.entry.tier) for s in steps)
        match = PrefixMatch(namespace, sum(s.n_tokens for s in steps), chunks)
        for s in steps:
            self._touch(s.entry)
        if not count:
            return match
        for s in steps:
            self._c.chunk_hits[s.entry.tier] += 1
        if match.tier is None:
            self._c.misses += 1
        else:
            self._c.hits[match.tier] += 1
        return match

    def _pin(self, match: PrefixMatch) -> list[Entry]:
        with self._lock:
            pinned = [e for e in (self._index.get(c.key) for c in match.chunks) if e is not None]
            for e in pinned:
                e.pins += 1
            return pinned

    def _unpin(self, pinned: list[Entry]) -> None:
        with self._lock:
            for e in pinned:
                e.pins -= 1

    @contextlib.contextmanager
    def acquire(self, match: PrefixMatch) -> Iterator[None]:
        """Pin the match's chunks (never evicted, never superseded) while a job uses them."""
        pinned = self._pin(match)
        try:
            yield
        finally:
            self._unpin(pinned)

    # ---- load and prefetch -------------------------------------------------------------------------

    def load(self, match: PrefixMatch, *, capacity: int | None = None) -> RestoredKV:
        """Start restoring the match's KV on a background thread; layer(i) of the result blocks per layer.
        `capacity`: tokens of room to allocate per layer (at least match.tokens), see RestoredKV."""
        restored = RestoredKV(match.tokens, self.layout, self.device, capacity)
        if match.tokens == 0:
            return restored
        plan: list[PlanItem] = []
        with self._lock:
            pinned: list[Entry] = []
            for c in match.chunks:
                e = self._index.get(c.key)
                if e is None or not e.usable:
                    self._unpin_locked(pinned)
                    self._c.misses += 1
                    self._c.load_errors += 1
                    restored._fail(KVLoadError(f"chunk {c.key} is no longer stored"))
                    restored._settled.set()
                    return restored
                e.pins += 1
                pinned.append(e)
                mem = e.data if e.data is not None else e.pending
                if mem is not None:
                    plan.append(PlanItem(c.key, c.n_tokens, mem=mem))
                else:
                    path = chunk_path(self._root, c.key)
                    plan.append(
                        PlanItem(c.key, c.n_tokens, path=path, meta=e.meta, buf=self._disk_buffer(e, c))
                    )
        threading.Thread(
            target=self._run_load, args=(plan, restored, pinned), name="kvtier-load", daemon=True
        ).start()
        return restored

    def _disk_buffer(self, e: Entry, c: ChunkRef) -> ChunkKV | None:
        """A host buffer to read an L2 chunk into, allocated here in the caller's thread (see RestoredKV),
        or None when the loader can read it straight into the output: host output, whole chunk used,
        and no memory tier that could take the chunk afterwards (promotion needs a copy of its own)."""
        promotable = any(self._budgets[t].capacity >= e.nbytes for t in MEMORY_TIERS)
        if self.device.type == "cpu" and c.n_tokens == e.n_tokens and not promotable:
            return None
        return ChunkKV.empty(self.layout, e.n_tokens, self._host, pin=self._pin_host)

    def _unpin_locked(self, pinned: list[Entry]) -> None:
        for e in pinned:
            e.pins -= 1

    def _run_load(self, plan: list[PlanItem], restored: RestoredKV, pinned: list[Entry]) -> None:
        try:
            self._load_and_promote(plan, restored, pinned)
        finally:
            restored._settled.set()

    def _load_and_promote(self, plan: list[PlanItem], restored: RestoredKV, pinned: list[Entry]) -> None:
        try:
            from_disk = run_load(plan, restored, self.layout, self.device)
        except LoadFailure as f:
            self._unpin(pinned)
            self._on_bad_chunk(f.item.key, f.cause)
            restored._fail(KVLoadError(str(f)))
            return
        except Exception as e:  # never leave the runner waiting forever
            self._unpin(pinned)
            log.exception("kvtier: load failed")
            restored._fail(KVLoadError(f"load failed: {e}"))
            return
        with self._lock:
            self._c.bytes_loaded += self._nbytes(restored.num_tokens)
            for e in pinned:  # promote what was read into the fastest tier that takes it
                if e.removed:
                    continue
                data = e.data if e.data is not None else from_disk.get(e.key)
                if data is not None and e.mem_tier != "l0":
                    self._place(e, data)
                self._touch(e)
            self._unpin_locked(pinned)

    def _on_bad_chunk(self, key: str, cause: BaseException) -> None:
        """A chunk failed to load: quarantine a bad file, forget the entry, count a miss."""
        path = chunk_path(self._root, key)
        if isinstance(cause, CorruptChunk):
            self._quarantine(path, str(cause))
        else:
            log.warning("kvtier: chunk %s could not be read: %s", key, cause)
        with self._lock:
            self._c.misses += 1
            self._c.load_errors += 1
            entry = self._index.get(key)
            if entry is not None and entry.data is None and entry.pending is None:
                self._remove(entry)  # its file is gone or quarantined already

    def prefetch(self, match: PrefixMatch) -> None:
        """Bring the match's L2-only chunks into L1 in the background (scheduler look-ahead). Never raises."""
        with contextlib.suppress(Exception):
            self._prefetcher.submit(self._prefetch, match)

    def _prefetch(self, match: PrefixMatch) -> None:
        for c in match.chunks:
            try:
                with self._lock:
                    e = self._index.get(c.key)
                    if e is None or e.data is not None or not e.on_disk or e.meta is None:
                        continue
                    e.pins += 1
                    meta = e.meta
                try:
                    data = read_chunk(chunk_path(self._root, c.key), meta, self.layout)
                except (CorruptChunk, OSError) as err:
                    self._unpin([e])
                    self._on_bad_chunk(c.key, err)
                    continue
                with self._lock:
                    if not e.removed and e.data is None:
                        self._place(e, data, ("l1",))
                    e.pins -= 1
            except Exception:
                log.exception("kvtier: prefetch of %s failed", c.key)

    # ---- put and save ------------------------------------------------------------------------------

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
        result = list(keys)
        with self._lock:
            todo = [
                i for i in range(len(spans)) if not self._have(i, spans, keys, parents, token_ids, result)
            ]
        if not todo:
            return result
        copies = self._copy_chunks(pairs, {i: spans[i] for i in todo})
        jobs: list[Entry] = []
        deletes: list[Path] = []
        with self._lock:
            for i in todo:
                if self._have(i, spans, keys, parents, token_ids, result):
                    continue  # another thread stored it meanwhile
                s, e = spans[i]
                entry = Entry(
                    keys[i], namespace, parents[i], tuple(token_ids[s:e]), session, self._nbytes(e - s)
                )
                self._index.add(entry)
                self._drop_superseded(entry, deletes)
                self._place(entry, copies[i])
                if self._saving_enabled and self._reserve_l2(entry, deletes):
                    entry.pending = copies[i]
                    self._pending += 1
                    jobs.append(entry)
                if not entry.usable:  # fits nowhere (everything pinned, or tiers disabled)
                    self._index.remove(entry.key)
        self._unlink(deletes)
        if self._saver is not None:
            for entry in jobs:
                self._saver.submit(entry)  # blocks when the queue is full: back-pressure
        elif jobs:
            self._save_entries(jobs)
        return result

    def _have(
        self,
        i: int,
        spans: list[tuple[int, int]],
        keys: list[str],
        parents: list[str],
        token_ids: list[int],
        result: list[str],
    ) -> bool:
        s, e = spans[i]
        toks = tuple(token_ids[s:e])
        entry = self._index.get(keys[i])
        if entry is not None and entry.usable and entry.token_ids == toks:
            return True
        if e - s < self.config.chunk_tokens:  # a partial chunk: is a longer sibling already covering it?
            for sib in self._index.children(parents[i]):
                if sib.usable and sib.n_tokens > len(toks) and sib.token_ids[: len(toks)] == toks:
                    result[i] = sib.key
                    return True
        return False

    def _copy_chunks(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], spans: dict[int, tuple[int, int]]
    ) -> dict[int, ChunkKV]:
        """One allocation per chunk, then every layer's K and V slice copied in, layer by layer (each
        source tensor is read once, front to back)."""
        chunks = {i: ChunkKV.empty(self.layout, e - s, self.device) for i, (s, e) in spans.items()}
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

    def _drop_superseded(self, entry: Entry, deletes: list[Path]) -> None:
        """A partial sibling whose tokens are a strict prefix of the new chunk's is now redundant."""
        for sib in self._index.children(entry.parent):
            if (
                sib is not entry
                and sib.pins == 0
                and sib.n_tokens < entry.n_tokens
                and entry.token_ids[: sib.n_tokens] == sib.token_ids
            ):
                deletes.extend(self._remove(sib))

    def _save_entry(self, entry: Entry) -> None:
        """Write one chunk's L2 file (a save worker, or put() itself when async_save is False)."""
        written: ChunkMeta | None = None
        try:
            with self._lock:
                data, enabled = entry.pending, self._saving_enabled
            if data is not None and enabled and not entry.removed:
                meta = ChunkMeta(entry.key, entry.namespace, entry.parent, entry.token_ids, entry.session, ())
                try:
                    written = write_chunk(self._root, meta, data, self.model_fingerprint, self.layout)
                except OSError as e:
                    self._save_failed(e)
        finally:
            self._save_done(entry, written)

    def _save_entries(self, entries: list[Entry]) -> None:
        """Write several chunks' L2 files in one batch (put() itself when async_save is False): every file
        is written before the first fsync, and each folder is fsynced once."""
        results: list[ChunkMeta | None] = [None] * len(entries)
        try:
            items: list[tuple[int, ChunkMeta, ChunkKV]] = []
            with self._lock:
                enabled = self._saving_enabled
                for j, entry in enumerate(entries):
                    if entry.pending is not None and enabled and not entry.removed:
                        meta = ChunkMeta(
                            entry.key, entry.namespace, entry.parent, entry.token_ids, entry.session, ()
                        )
                        items.append((j, meta, entry.pending))
            if items:
                written = write_chunks(
                    self._root, [(m, d) for _, m, d in items], self.model_fingerprint, self.layout
                )
                for (j, _, _), w in zip(items, written, strict=True):
                    if isinstance(w, OSError):
                        self._save_failed(w)
                    else:
                        results[j] = w
        finally:
            for entry, w in zip(entries, results, strict=True):
                self._save_done(entry, w)

    def _save_failed(self, e: OSError) -> None:
        with self._lock:
            self._c.save_errors += 1
            if e.errno == errno.ENOSPC and self._saving_enabled:
                self._saving_enabled = False
                log.warning("kvtier: disk full (%s); saving to L2 stops, serving goes on", e)
            else:
                log.warning("kvtier: saving a chunk failed: %s", e)

    def _save_done(self, entry: Entry, written: ChunkMeta | None) -> None:
        orphan = False
        with self._lock:
            entry.pending = None
            self._pending -= 1
            if entry.removed:
                orphan = written is not None  # forgotten or superseded while being written
            elif written is not None:
                entry.on_disk, entry.meta = True, written
                self._c.bytes_saved += entry.nbytes
            else:
                self._budgets["l2"].remove(entry.key)
                if not entry.usable:
                    self._index.remove(entry.key)
            self._cond.notify_all()
        if orphan:
            self._unlink([chunk_path(self._root, entry.key)])

    # ---- forget, stats, lifecycle ------------------------------------------------------------------

    def _forget(self, pred: Callable[[Entry], bool]) -> int:
        deletes: list[Path] = []
        with self._lock:
            victims = [e for e in self._index.entries() if pred(e)]
            for e in victims:
                deletes.extend(self._remove(e))
        self._unlink(deletes)
        return len(victims)

    def forget_session(self, namespace: str, session: str) -> int:
        """Drop the chunks this session stored (first writer wins the tag) from every tier."""
        return self._forget(lambda e: e.namespace == namespace and e.session == session)

    def forget_namespace(self, namespace: str) -> int:
        return self._forget(lambda e: e.namespace == namespace)

    def stats(self) -> StoreStats:
        with self._lock:
            b, c = self._budgets, self._c
            return StoreStats(
                tiers={t: TierStats(b[t].used, b[t].capacity, len(b[t])) for t in TIERS},
                hits=dict(c.hits),
                chunk_hits=dict(c.chunk_hits),
                misses=c.misses,
                evictions=sum(b[t].evictions for t in TIERS),
                evictions_by_tier={t: b[t].evictions for t in TIERS},
                bytes_loaded=c.bytes_loaded,
                bytes_saved=c.bytes_saved,
                saves_pending=self._pending,
                save_errors=c.save_errors,
                saving_enabled=self._saving_enabled,
                load_errors=c.load_errors,
                quarantined=c.quarantined,
            )

    def flush(self, timeout: float | None = None) -> None:
        """Wait until no save is pending (or the timeout passes)."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        if self._saver is not None:
            self._saver.close()
        self._prefetcher.shutdown(wait=True)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KVStore"]
