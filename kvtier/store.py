"""KVStore: the facade the runner uses. It answers lookups and takes puts itself, and hands the rest to
one part per idea, around one StoreCore (core.py: the lock, the index, the ordered tiers, the counters):

    tier_registry.py  the tiers, one backend each (tier_interface.py), built from the config
    placement.py      moves between tiers, demotion and eviction (eviction.py, schedule.py)
    adoption.py       stored chunks: scan, by key
    lookup.py         longest stored prefix, chains of keys
    saving.py         background writes
    loading.py        the load path: load threads, layer by layer, promotion
    prefetch.py       the scheduler's look-ahead
    retention.py      sessions kept ahead of idle ones until a deadline (agents waiting on a tool)

The invariants (stated in core.py): no tier above capacity, pinned entries never evicted, an entry
leaves the index when no tier holds it; tensor copies and disk I/O happen outside the lock.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from .adoption import Adoption
from .chunk import ChunkId, ChunkKV, SideStreams, copy_blocks, copy_blocks_to_host, copy_chunks
from .chunk_keys import chain, chunk_spans, root_key
from .config import PrefixMatch, StoreConfig
from .core import StoreCore
from .index import Entry
from .layout import KVLayout, normalize_layers
from .loading import Loading
from .lookup import Lookups
from .memory_tier import Copy
from .pinned_pool import STAGING_CHUNKS, PinnedPoolWarmer, empty_host_cache
from .placement import Placement
from .prefetch import Prefetching
from .restored_kv import PagedTarget, RestoredKV
from .saving import Save, Saving
from .schedule import Schedule
from .stats import StoreStats, TierStats
from .tier_names import Tier
from .tier_registry import TierFactory, build_tiers


class KVStore:
    def __init__(
        self,
        config: StoreConfig,
        layout: KVLayout,
        model_fingerprint: str,
        *,
        tiers: Mapping[Tier, TierFactory] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`tiers`: backends to use instead of the registered ones for some tiers (tier_registry.py).
        `clock`: seconds, what retention deadlines are measured on (tests pass their own)."""
        self.config = config
        self.layout = layout
        self.model_fingerprint = model_fingerprint
        self._core = core = StoreCore(
            config,
            layout,
            model_fingerprint,
            build_tiers(config, layout, model_fingerprint, tiers),
            clock=clock,
        )
        self.device = core.device
        self._closed = False
        self._placement = Placement(core)
        self._adoption = Adoption(core, self._placement)
        self._adoption.scan()
        self._lookups = Lookups(core, self._placement, self._adoption)
        self._loading = Loading(core, self._placement)
        self._prefetching = Prefetching(core, self._placement, self._loading)
        self._saving = Saving(core, self._placement)
        self._pinned_pool = _grow_pinned_pool(core)
        self._page_reads = SideStreams()  # put's copies of blocks straight to the host (_copy_blocks)

    # ---- keys -------------------------------------------------------------------------------------

    def _root_key(self, namespace: str) -> str:
        return root_key(self.model_fingerprint, self.layout.describe(), namespace)

    def chain_keys(self, namespace: str, token_ids: Sequence[int]) -> list[str]:
        return chain(self._root_key(namespace), list(token_ids), self.config.chunk_tokens)

    def chain_tokens(self, namespace: str, keys: Sequence[str]) -> list[int]:
        """The token ids of a stored chain of chunk keys (a sequence as put() returned its keys), up to
        the first key that is missing, not this namespace's, or not the next link of the chain. Adopts
        files another replica wrote, as lookup() does with hint keys."""
        return self._lookups.chain_tokens(self._root_key(namespace), namespace, keys)

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
        return self._lookups.lookup(self._root_key(namespace), namespace, list(token_ids), hint_keys, count)

    @contextlib.contextmanager
    def acquire(self, match: PrefixMatch) -> Iterator[None]:
        """Pin the match's chunks (never evicted, never superseded) while a job uses them."""
        core = self._core
        with core.lock:
            pinned = core.pin(e for e in (core.index.get(c.key) for c in match.chunks) if e is not None)
        try:
            yield
        finally:
            core.unpin(pinned)

    # ---- load and prefetch -------------------------------------------------------------------------

    def load(
        self,
        match: PrefixMatch,
        *,
        capacity: int | None = None,
        out: Sequence[tuple[torch.Tensor, torch.Tensor]] | PagedTarget | None = None,
    ) -> RestoredKV:
        """Start restoring the match's KV on a load thread; layer(i) of the result blocks per layer.
        `capacity`: tokens of room to allocate per layer (at least match.tokens), see RestoredKV.
        `out`: the caller's own per-layer (K, V) buffers, [1, heads, >= match.tokens, head_dim] each,
        to restore into instead (nothing is allocated), or a PagedTarget (chunk j into page j of the
        caller's pool); they must stay untouched until the result is `ready` (a failed or cancelled job
        waits for that before it reuses them)."""
        return self._loading.load(match, capacity, out)

    def prefetch(self, match: PrefixMatch) -> None:
        """Bring the match's chunks up in the background (disk to host, into L0 where it has room without
        evicting what the schedule protects): the scheduler's look-ahead. Never raises."""
        self._prefetching.prefetch(match)

    def shed_memory(self, nbytes: int) -> int:
        """The machine runs short of memory: free up to `nbytes` of L1 then L0 by dropping the memory
        copies of chunks that are safe in L2 (pinned and schedule-protected chunks stay). Returns bytes
        freed (their tensors go as soon as no load is reading them). On CUDA torch's pinned cache is
        emptied too, freed or not: it keeps freed blocks, and those grown at start, for later chunks,
        page-locked and so never available to the machine, which is short now."""
        with self._core.lock:
            freed = self._placement.shed(nbytes)
        if self._core.pin_host:
            empty_host_cache()
        return freed

    def wait_pinned_pool(self, timeout: float | None = None) -> bool:
        """Block until the pinned host pool has grown (benchmarks, tests); True at once off CUDA."""
        return self._pinned_pool is None or self._pinned_pool.wait(timeout)

    def shed_device_memory(self) -> int:
        """The device ran out of memory: move every evictable L0 chunk to L1 (or drop its memory copy
        when L1 has no room and it is on disk). Returns the bytes that left L0."""
        core = self._core
        copies: list[Copy] = []
        with core.lock:
            freed = self._placement.demote_all(core.memory[0], copies)
        core.run_copies(copies)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def load_rates(self) -> dict[Tier, float]:
        """Restore bandwidth measured per tier (bytes/s, a moving average over this store's loads); a tier
        no load has measured yet is absent."""
        return self._core.load_rates.snapshot()

    def wait_copies(self) -> None:
        """Block until every memory tier's buffers hold their bytes (copies to or from a device run on
        side streams and complete later): benchmarks and tests."""
        core = self._core
        with core.lock:
            events = [
                data.written
                for tier in core.memory
                for key in tier.held()
                if (data := tier.read(key)) is not None and data.written is not None
            ]
        for event in events:
            event.synchronize()

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Block until every prefetch asked for so far has run (False if the timeout passed first)."""
        return self._prefetching.wait_idle(timeout)

    def set_schedule(self, schedule: Schedule | None) -> None:
        """The runner's queue as eviction sees it (schedule.py); None: each tier's own policy order."""
        self._core.set_schedule(schedule)

    def retain(self, namespace: str, session: str, seconds: float) -> float:
        """Keep this session's chunks (those it stored, and the chains they continue) where they are for
        `seconds`: every tier gives up every unretained chunk before them, and the earliest deadline
        first among retained ones (retention.py). The chunks the session stores meanwhile are kept too.
        A hold already running longer stays as it is. Returns the deadline (on the store's clock)."""
        with self._core.lock:
            return self._core.retention.retain(namespace, session, seconds)

    # ---- put ---------------------------------------------------------------------------------------

    def put(
        self,
        namespace: str,
        token_ids: Sequence[int],
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        *,
        blocks: Sequence[torch.Tensor] | None = None,
        session: str | None = None,
        on_blocks_read: Callable[[torch.cuda.Event], None] | None = None,
    ) -> list[str]:
        """Store the chunks of token_ids not stored yet (copies them); returns the keys covering token_ids.
        The KV comes as `layers` (per layer (K, V), [1, heads, >= tokens, head_dim]) or as `blocks` (per
        chunk, [layers, 2, heads, n, head_dim]: a paged pool's pages, chunk_tokens each but the last).

        On CUDA, blocks may still be read on a side stream once put returns (see _copy_blocks): put then
        calls `on_blocks_read` with the event after those reads, and the caller writes that memory again
        only after it (an engine's freed pages wait for it before their reuse). Without `on_blocks_read`
        the caller's current stream waits for that event instead.

        For a final partial chunk already covered by a longer stored sibling, the sibling's key is returned.
        """
        token_ids = list(token_ids)
        if not token_ids:
            return []
        if (layers is None) == (blocks is None):
            raise ValueError("put takes the KV as layers or as blocks, one of the two")
        spans = chunk_spans(len(token_ids), self.config.chunk_tokens)
        pairs = normalize_layers(layers, self.layout, len(token_ids)) if layers is not None else []
        if blocks is not None:
            _check_blocks(blocks, spans, self.layout)
        keys = self.chain_keys(namespace, token_ids)
        parents = [self._root_key(namespace), *keys[:-1]]
        chunks = [
            ChunkId(keys[i], namespace, parents[i], tuple(token_ids[s:e]), session)
            for i, (s, e) in enumerate(spans)
        ]
        result = list(keys)
        core = self._core
        with core.lock:
            todo = [i for i, c in enumerate(chunks) if not self._have(c, result, i)]
        if not todo:
            return result
        if blocks is not None:  # no lock held
            data = self._copy_blocks(blocks, todo, on_blocks_read)
            todo = [i for i in todo if i in data]
        else:
            data = copy_chunks(pairs, {i: spans[i] for i in todo}, self.layout, self.device)
        saves: list[Save] = []
        deletes: list[str] = []
        copies: list[Copy] = []
        with core.lock:
            new: list[tuple[Entry, ChunkKV]] = []
            for i in todo:
                if self._have(chunks[i], result, i):
                    continue  # another thread stored it meanwhile
                entry = Entry(chunks[i], core.nbytes(chunks[i].n_tokens))
                core.index.add(entry)
                self._drop_superseded(entry, deletes)
                save = self._saving.reserve(entry, data[i], deletes)  # head first: a full queue skips the end
                if save is not None:
                    saves.append(save)
                new.append((entry, data[i]))
            # The deepest first: where the chain does not fit, its own end gives way to its head (placed
            # later, so used more recently), never the other way round (see Placement.touch_chain).
            host_keep = [t for t in core.keep if t.device.type == "cpu"]
            for entry, chunk_data in reversed(new):
                on_host = chunk_data.buf.device != self.device  # a page copied to the host: no tier above
                self._placement.place(entry, chunk_data, copies, host_keep if on_host else core.keep)
            for entry, _ in new:
                if not core.usable(entry):  # fits nowhere (everything pinned, or tiers disabled)
                    core.index.remove(entry.key)
            chain = [e for e in map(core.index.get, result) if e is not None]
            self._placement.touch_chain(chain, counted=False)  # the prefix above the new chunks, later
        core.run_copies(copies)
        if saves and self.device.type == "cuda":
            with core.lock:
                saves = self._saving.from_host_copies(saves)
        core.backing.delete(deletes)
        self._saving.submit(saves)  # never blocks: a save the full queue cannot take is skipped
        return result

    def _copy_blocks(
        self,
        blocks: Sequence[torch.Tensor],
        todo: list[int],
        on_blocks_read: Callable[[torch.cuda.Event], None] | None,
    ) -> dict[int, ChunkKV]:
        """The new chunks' blocks copied into buffers of the store's own (no lock held).

        On CUDA, only the chunks the fastest kept tier can hold go into device buffers: the chain's head
        (placed last, so what that tier keeps), as many as its capacity takes. The rest go straight to
        pinned host buffers on the store's page-read stream, after the caller's stream: copying a long
        turn's every chunk on the device first (3.7 GiB at 30k tokens of an 8B model) would take device
        memory no budget counts, only for most of it to cross to the host at once, and a copy to the
        host on the caller's stream would hold up its next step. Chunks that neither a host tier nor the
        save queue could take are not copied at all (_host_keeps)."""
        core, config = self._core, self.config
        fastest = core.keep[0] if core.keep else None
        if self.device.type != "cuda" or not todo:
            return copy_blocks(blocks, todo, self.device)
        chunk = core.nbytes(config.chunk_tokens)
        on_device = fastest.capacity // chunk if fastest is not None and fastest.device.type == "cuda" else 0
        head, rest = todo[:on_device], todo[on_device:]
        rest = rest[: self._host_keeps(len(head), len(rest))]
        data = copy_blocks(blocks, head, self.device) if head else {}
        if rest:
            on_host, read = copy_blocks_to_host(blocks, rest, self._page_reads.get(self.device))
            data.update(on_host)
            if on_blocks_read is not None:
                on_blocks_read(read)
            else:
                torch.cuda.current_stream(self.device).wait_event(read)
        return data

    def _host_keeps(self, head: int, rest: int) -> int:
        """How many of a put's chunks past L0's `head` could stay anywhere once copied to the host: what
        the host tiers hold, or the saves the queue can take after the head's (a save reserves head
        first). Copying more would page-lock host memory (kept by torch's pinned cache) only for the
        chunks to be dropped at once."""
        core, config = self._core, self.config
        chunk = core.nbytes(config.chunk_tokens)
        keeps = sum(t.capacity for t in core.keep if t.device.type == "cpu") // chunk
        if core.backing.capacity and self._saving.enabled:
            slots = config.save_queue_chunks + config.save_workers if config.async_save else head + rest
            keeps = max(keeps, slots - head)
        return min(rest, keeps)

    def _have(self, chunk: ChunkId, result: list[str], i: int) -> bool:
        """With the lock held: is this chunk stored already? A partial chunk counts as stored when a
        longer stored sibling covers it (its key then replaces result[i])."""
        core = self._core
        entry = core.index.get(chunk.key)
        if entry is not None and core.usable(entry) and entry.chunk.token_ids == chunk.token_ids:
            return True
        toks = chunk.token_ids
        if len(toks) < self.config.chunk_tokens:
            for sib in core.index.children(chunk.parent):
                if core.usable(sib) and sib.n_tokens > len(toks) and sib.chunk.token_ids[: len(toks)] == toks:
                    result[i] = sib.key
                    return True
        return False

    def _drop_superseded(self, entry: Entry, deletes: list[str]) -> None:
        """With the lock held: a partial sibling whose tokens are a strict prefix of the new chunk's is
        now redundant."""
        for sib in self._core.index.children(entry.chunk.parent):
            if (
                sib is not entry
                and sib.pins == 0
                and sib.n_tokens < entry.n_tokens
                and entry.chunk.token_ids[: sib.n_tokens] == sib.chunk.token_ids
            ):
                deletes.extend(self._placement.remove(sib))

    # ---- forget, stats, lifecycle ------------------------------------------------------------------

    def _forget(self, pred: Callable[[ChunkId], bool]) -> int:
        core = self._core
        deletes: list[str] = []
        with core.lock:
            victims = [e for e in core.index.entries() if pred(e.chunk)]
            for e in victims:
                deletes.extend(self._placement.remove(e))
        core.backing.delete(deletes)
        return len(victims)

    def forget_session(self, namespace: str, session: str) -> int:
        """Drop the chunks this session stored (first writer wins the tag) from every tier, and its
        retention."""
        with self._core.lock:
            self._core.retention.release(namespace, session)
        return self._forget(lambda c: c.namespace == namespace and c.session == session)

    def forget_namespace(self, namespace: str) -> int:
        return self._forget(lambda c: c.namespace == namespace)

    def stats(self) -> StoreStats:
        core = self._core
        with core.lock:
            c = core.counters
            retained = core.retained()
            return StoreStats(
                tiers={t.name: TierStats(t.used, t.capacity, len(t)) for t in core.tiers},
                hits=dict(c.hits),
                chunk_hits=dict(c.chunk_hits),
                misses=c.misses,
                evictions=sum(t.evictions for t in core.tiers),
                evictions_by_tier={t.name: t.evictions for t in core.tiers},
                bytes_loaded=c.bytes_loaded,
                bytes_saved=c.bytes_saved,
                saves_pending=self._saving.pending,
                save_errors=c.save_errors,
                saves_skipped=c.saves_skipped,
                saving_enabled=self._saving.enabled,
                load_errors=c.load_errors,
                quarantined=c.quarantined,
                reused_tokens=dict(c.reused_tokens),
                prefetch_issued=c.prefetch_issued,
                prefetch_completed=c.prefetch_completed,
                prefetch_used=c.prefetch_used,
                prefetch_wasted=c.prefetch_wasted,
                retained_sessions=len(core.retention.holds()),
                retained_bytes={
                    t.name: sum(e.nbytes for k in retained if k in t and (e := core.index.get(k)) is not None)
                    for t in core.tiers
                },
                retention_evictions=c.retention_evictions,
            )

    def flush(self, timeout: float | None = None) -> None:
        """Wait until no save is pending (or the timeout passes)."""
        self._saving.flush(timeout)

    def close(self) -> None:
        """Wait for loads, prefetches and saves in flight, then stop their threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pinned_pool is not None:
            self._pinned_pool.close()
        self._prefetching.close()
        self._loading.close()
        self._saving.close()
        self._core.backing.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _grow_pinned_pool(core: StoreCore) -> PinnedPoolWarmer | None:
    """On CUDA, torch's pinned pool grown once for this store's L1 and staging (pinned_pool.py)."""
    if not core.pin_host:
        return None
    config = core.config
    block = core.nbytes(config.chunk_tokens)
    if config.pinned_pool_bytes is not None:
        blocks = config.pinned_pool_bytes // block
    else:
        # with L2: one load's staging, or the host copies of a put's chunks the save queue holds
        # (_host_keeps), whichever is more (they rarely peak together)
        staging = max(STAGING_CHUNKS, config.save_queue_chunks + config.save_workers)
        blocks = config.l1_capacity_bytes // block + (staging if config.l2_capacity_bytes else 0)
    return PinnedPoolWarmer(block, blocks) if blocks > 0 else None


def _check_blocks(blocks: Sequence[torch.Tensor], spans: list[tuple[int, int]], layout: KVLayout) -> None:
    """put's blocks must be one per chunk, each [layers, 2, heads, n, head_dim] of the chunk's n tokens."""
    if len(blocks) != len(spans):
        raise ValueError(f"put: {len(blocks)} blocks for {len(spans)} chunks")
    for b, (s, e) in zip(blocks, spans, strict=True):
        want = (layout.num_layers, 2, layout.num_kv_heads, e - s, layout.head_dim)
        if tuple(b.shape) != want or b.dtype != layout.dtype:
            raise ValueError(f"put: a block of {tuple(b.shape)} {b.dtype}, expected {want} {layout.dtype}")


__all__ = ["KVStore"]
