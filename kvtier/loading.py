"""The load path: restoring a match's chunks on threads the store owns (closed with it).

A load pins its chunks and plans where each is read from (a memory tier, or the persistent tier). A
load thread then fills the RestoredKV (restored_kv.py: the handle the runner reads) layer by layer, in
layer order, so the runner can compute layer i while layer i+1 is still being read from disk; then it
promotes what it read into the fastest memory tier that takes it (StoreCore.keep) and unpins. A chunk
that fails to read is quarantined (if its stored copy is bad) and forgotten: a miss, never a wrong
answer.

    Loading        the store's side: pin, plan, submit, promote, handle bad chunks (lock held briefly)
    run_load       the load thread's layer loop (no lock, no store state: plan in, layers out)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .chunk import ChunkKV, SideStreams, host_bytes
from .chunk_format import ChunkMeta, CorruptChunk
from .config import ChunkRef, PrefixMatch
from .core import StoreCore
from .index import Entry
from .layout import KVLayout
from .memory_tier import Copy
from .persistent_tier import LayerReader
from .placement import Placement
from .restored_kv import KVLoadError, PagedTarget, RestoredKV
from .tier_names import Tier, tier_rank

log = logging.getLogger(__name__)

OpenReader = Callable[[str, ChunkMeta], LayerReader]
"""Opens a stored chunk for layer-wise reads (the persistent tier's `reader`)."""


@dataclass
class PlanItem:
    """One chunk of a load: read from memory (`mem`) or from the persistent tier (`meta`)."""

    key: str
    n_tokens: int
    tier: Tier
    mem: ChunkKV | None = None
    meta: ChunkMeta | None = None
    buf: ChunkKV | None = None  # host buffer for a disk chunk (to promote, to move to a device, or partial)
    # A disk chunk whose pinned host buffer, of this many tokens, the load thread allocates (`buf`).
    pinned_tokens: int = 0


class LoadFailure(Exception):
    """A chunk of the plan could not be read (`cause` says why)."""

    def __init__(self, item: PlanItem, cause: BaseException) -> None:
        super().__init__(f"chunk {item.key}: {cause}")
        self.item = item
        self.cause = cause


class Loading:
    def __init__(self, core: StoreCore, placement: Placement) -> None:
        self._core = core
        self._placement = placement
        self._loaders = ThreadPoolExecutor(core.config.load_workers, thread_name_prefix="kvtier-load")
        # Disk reads of a load, several chunks at once (the page cache and NVMe both serve parallel
        # reads faster than one stream of them).
        self._reads = ThreadPoolExecutor(core.config.read_workers, thread_name_prefix="kvtier-read")
        # Each load thread's restores on a stream of its own, high priority (a step waits for them).
        self._streams = SideStreams(priority=-1, per_thread=True)

    def close(self) -> None:
        """Wait for loads in flight; later ones fail."""
        self._loaders.shutdown(wait=True)
        self._reads.shutdown(wait=True)

    def load(
        self,
        match: PrefixMatch,
        capacity: int | None,
        out: Sequence[tuple[torch.Tensor, torch.Tensor]] | PagedTarget | None = None,
    ) -> RestoredKV:
        core = self._core
        restored = RestoredKV(match.tokens, core.layout, core.device, capacity, out)
        if match.tokens == 0:
            return restored
        with core.lock:
            entries = [core.index.get(c.key) for c in match.chunks]
            gone = next(
                (c for c, e in zip(match.chunks, entries, strict=True) if e is None or not core.usable(e)),
                None,
            )
            if gone is not None:
                core.counters.load_failed()
                restored.fail(KVLoadError(f"chunk {gone.key} is no longer stored"))
                restored.settle()
                return restored
            pinned = core.pin(e for e in entries if e is not None)
            plan = [self._plan_item(e, c) for e, c in zip(pinned, match.chunks, strict=True)]
        try:
            self._loaders.submit(self._run, plan, restored, pinned)
        except RuntimeError:  # closed
            core.unpin(pinned)
            restored.fail(KVLoadError("the store is closed"))
            restored.settle()
        return restored

    def _plan_item(self, e: Entry, c: ChunkRef) -> PlanItem:
        """With the lock held: read the chunk from memory if a tier (or a save in flight) holds it, else
        from the persistent tier."""
        mem = self._core.memory_copy(e.key)
        if mem is not None:
            return PlanItem(c.key, c.n_tokens, self._core.tier_of(e), mem=mem)
        meta = self._core.backing.read(e.key)
        if self._core.pin_host:  # allocated by the load thread (see _allocate_pinned)
            return PlanItem(c.key, c.n_tokens, self._core.backing.name, meta=meta, pinned_tokens=e.n_tokens)
        return PlanItem(c.key, c.n_tokens, self._core.backing.name, meta=meta, buf=self._disk_buffer(e, c))

    def _disk_buffer(self, e: Entry, c: ChunkRef) -> ChunkKV | None:
        """A host buffer to read a stored chunk into, allocated here in the caller's thread (see
        RestoredKV), or None when the loader can read it straight into the output: host output, whole
        chunk used, and no memory tier that could take the chunk afterwards (promotion needs a copy)."""
        core = self._core
        if core.device.type == "cpu" and c.n_tokens == e.n_tokens and not core.fits_in_memory(e.nbytes):
            return None
        return ChunkKV.empty(core.layout, e.n_tokens, torch.device("cpu"))

    def _allocate_pinned(self, plan: list[PlanItem]) -> None:
        """On the load thread: the pinned host buffers of the plan's disk chunks. Not in the caller's
        thread (the step's, under the store lock): torch's pinned pool serves every thread alike, and
        growing it is a cudaHostAlloc per buffer, which page-locks it then, and no step should wait."""
        for item in plan:
            if item.pinned_tokens and item.buf is None:
                item.buf = ChunkKV.empty(self._core.layout, item.pinned_tokens, torch.device("cpu"), pin=True)

    def _run(self, plan: list[PlanItem], restored: RestoredKV, pinned: list[Entry]) -> None:
        """A load thread: fill the output, then promote; the RestoredKV settles whatever happens."""
        core = self._core
        started = time.perf_counter()
        try:
            self._allocate_pinned(plan)
            from_disk = run_load(plan, restored, core.layout, core.backing.reader, self._reads, self._streams)
            slowest = max((item.tier for item in plan), key=tier_rank)
            nbytes = core.nbytes(sum(item.n_tokens for item in plan))
            core.load_rates.observe(slowest, nbytes, time.perf_counter() - started)
        except LoadFailure as f:
            core.unpin(pinned)
            self.on_bad_chunk(f.item.key, f.cause)
            for key, cause in other_bad_chunks(plan, f.item.key, core.backing.read_all):
                self.on_bad_chunk(key, cause)  # every bad chunk of the match at once
            restored.fail(KVLoadError(str(f)))
        except Exception as e:  # never leave the runner waiting forever
            core.unpin(pinned)
            log.exception("kvtier: load failed")
            restored.fail(KVLoadError(f"load failed: {e}"))
        else:
            self._promote(pinned, from_disk, restored.num_tokens)
        finally:
            restored.settle()

    def _promote(self, pinned: list[Entry], from_disk: dict[str, ChunkKV], n_tokens: int) -> None:
        """Put what was read into the fastest memory tier that takes it, then unpin."""
        core = self._core
        copies: list[Copy] = []
        try:
            with core.lock:
                core.counters.loaded(core.nbytes(n_tokens))
                live = [e for e in pinned if not e.removed]
                for e in live:
                    tier = core.memory_tier_of(e.key)
                    data = tier.read(e.key) if tier is not None else from_disk.get(e.key)
                    if data is not None and tier is not core.memory[0]:
                        self._placement.place(e, data, copies, core.keep)
                self._placement.touch_chain(live)
            core.run_copies(copies)
        except Exception:
            log.exception("kvtier: promotion after a load failed")
        finally:
            core.unpin(pinned)

    def on_bad_chunk(self, key: str, cause: BaseException) -> None:
        """A chunk failed to load: quarantine a bad stored copy, forget the entry, count a miss."""
        core = self._core
        if isinstance(cause, CorruptChunk):
            core.quarantine(key, str(cause))
        else:
            log.warning("kvtier: chunk %s could not be read: %s", key, cause)
        with core.lock:
            core.counters.load_failed()
            entry = core.index.get(key)
            if entry is not None and core.memory_copy(key) is None:
                self._placement.remove(entry)  # its stored copy is gone or quarantined already


# ---- the load thread's layer loop ----------------------------------------------------------------


def run_load(
    plan: list[PlanItem],
    restored: RestoredKV,
    layout: KVLayout,
    open_reader: OpenReader,
    reads: Executor | None = None,
    streams: SideStreams | None = None,
) -> dict[str, ChunkKV]:
    """Fill `restored` layer by layer. Returns {key: ChunkKV} of the chunks read from disk into host
    buffers (to promote). A disk chunk without a buffer (`buf`) is read straight into the output and
    checksummed there, before that layer is handed out. `reads`: threads that read the disk chunks'
    layers in parallel (READ_AHEAD layers ahead of the copies); without it, one read after another.
    `streams`: where the copies to CUDA run (else a pooled stream: a test's).

    Raises LoadFailure naming the first chunk that could not be read.
    """
    readers: dict[str, LayerReader] = {}
    from_disk: dict[str, ChunkKV] = {}
    try:
        for item in plan:
            if item.mem is None:
                assert item.meta is not None
                try:
                    readers[item.key] = open_reader(item.key, item.meta)
                except Exception as e:
                    raise LoadFailure(item, e) from e
                if item.buf is not None:
                    from_disk[item.key] = item.buf
        srcs = [(item.mem or item.buf) for item in plan]
        src_bytes = [c.host_bytes() if c is not None else None for c in srcs]
        device = restored.target_tensors[0].device
        # On CUDA the host-to-device copies run on a stream of their own, one event per layer, so layer
        # i+1 copies while the model computes layer i on its stream (the paper's layer-wise pre-loading).
        stream = None
        if device.type == "cuda":
            stream = streams.get(device) if streams is not None else torch.cuda.Stream(device)
        try:
            if stream is not None:
                _order_copy_stream(stream, restored, layout, srcs)
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with ctx:
                if _device_resident(plan, restored):
                    _fill_chunks(plan, restored, layout, srcs, stream)
                else:
                    _fill_layers(plan, restored, layout, readers, srcs, src_bytes, stream, reads)
        finally:
            if stream is not None:
                # The load settles only once its copies are done on the device, failed or not: `ready`
                # then means the targets are no longer written and every source may be freed.
                stream.synchronize()
    finally:
        for r in readers.values():
            r.close()
    return from_disk


def _order_copy_stream(
    stream: torch.cuda.Stream, restored: RestoredKV, layout: KVLayout, srcs: list[ChunkKV | None]
) -> None:
    """Make the copy stream safe to use before the first copy is queued on it.

    It waits on the caller's stream as the load began (the targets are free to write) and on every
    source buffer's producer (`written`: an L0 chunk still being filled on the runner's stream). Every
    device buffer it touches is recorded as in use by it, so the caching allocator hands that memory to
    no one else until the copies are done, even if a cancelled job drops its targets or the store
    evicts a source meanwhile.
    """
    if restored.targets_free is not None:
        stream.wait_event(restored.targets_free)
    for src in srcs:
        if src is None:
            continue
        if src.written is not None:
            stream.wait_event(src.written)
        if src.buf.is_cuda:
            src.buf.record_stream(stream)
    for t in restored.target_tensors:
        if t.is_cuda:
            t.record_stream(stream)


def _copy(dst: torch.Tensor, src: torch.Tensor, src_bytes: np.ndarray | None) -> None:
    """dst <- src: numpy's memcpy-speed copy between host tensors (`src_bytes`: src's bytes, or None
    when src is not on the host), else a tensor copy queued on the current stream."""
    dst_bytes = host_bytes(dst)
    if src_bytes is not None and dst_bytes is not None:
        np.copyto(dst_bytes, src_bytes)
    else:
        dst.copy_(src, non_blocking=True)


# Layers a load reads from disk ahead of the one it copies (each read fills its own part of a buffer).
READ_AHEAD = 2


def _device_resident(plan: list[PlanItem], restored: RestoredKV) -> bool:
    """Every chunk is in memory on the paged target's device (an L0 hit): whole chunks are copied."""
    paged = restored.paged
    if paged is None or paged.pool.device.type != "cuda":
        return False
    return all(item.mem is not None and item.mem.buf.device == paged.pool.device for item in plan)


def _fill_chunks(
    plan: list[PlanItem],
    restored: RestoredKV,
    layout: KVLayout,
    srcs: list[ChunkKV | None],
    stream: torch.cuda.Stream | None,
) -> None:
    """Device to device (an L0 hit into pages): one copy per chunk across every layer (at the device's
    bandwidth, launch-bound if copied layer by layer), then every layer handed out after one event."""
    paged = restored.paged
    assert paged is not None
    for j, (item, src) in enumerate(zip(plan, srcs, strict=True)):
        assert src is not None
        paged.pool[:, paged.pages[j], :, :, : item.n_tokens].copy_(
            src.buf[..., : item.n_tokens, :], non_blocking=True
        )
    event = None
    if stream is not None:
        event = torch.cuda.Event(enable_timing=True)  # layer_events() are timed, an L0 hit's too
        event.record(stream)
    for i in range(layout.num_layers):
        restored.mark_loaded(i, event)


def _fill_layers(
    plan: list[PlanItem],
    restored: RestoredKV,
    layout: KVLayout,
    readers: dict[str, LayerReader],
    srcs: list[ChunkKV | None],
    src_bytes: list[np.ndarray | None],
    stream: torch.cuda.Stream | None,
    reads: Executor | None,
) -> None:
    """run_load's layer loop: each layer from every chunk of the plan, then handed to readers. A paged
    target takes each chunk's layer (K and V) in one copy into its page; a per-layer target takes K and
    V apart at the chunk's position. Disk chunks' layers are read READ_AHEAD layers ahead, in parallel."""
    paged = restored.paged
    starts = [sum(item.n_tokens for item in plan[:j]) for j in range(len(plan))]
    # A host pool's bytes, viewed once: a disk read's destination is then a numpy slice of it, not a
    # torch index and view per read (a small model's chunk layer is ~100 KiB, so that overhead was a
    # third of a read's time).
    pool_bytes = host_bytes(paged.pool) if paged is not None else None

    def destinations(i: int, j: int, n: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        if paged is not None:
            dst = paged.block(i, j, n)  # [2, heads, n, dim]
            return dst, dst[0], dst[1]
        out_k, out_v = restored.target(i)
        pos = starts[j]
        return None, out_k[0, :, pos : pos + n], out_v[0, :, pos : pos + n]

    def read(i: int, j: int) -> None:
        item = plan[j]
        reader = readers[item.key]
        try:
            if item.buf is not None:
                reader.read_chunk_layer(i, item.buf)
            else:  # whole chunk used, host output: read it in place, verify it there
                if pool_bytes is not None and paged is not None:
                    ok, ov = pool_bytes[i, paged.pages[j], :, :, : item.n_tokens]
                else:
                    _, dst_k, dst_v = destinations(i, j, item.n_tokens)
                    ok, ov = host_bytes(dst_k), host_bytes(dst_v)
                assert ok is not None and ov is not None
                reader.read_layer_into(i, _byte_runs(ok), _byte_runs(ov))
        except Exception as e:
            raise LoadFailure(item, e) from e

    disk = [j for j, item in enumerate(plan) if item.mem is None]
    pending: dict[int, list[Future[None]]] = {}

    def start_reads(i: int) -> None:
        if reads is not None and disk and i < layout.num_layers:
            pending[i] = [reads.submit(read, i, j) for j in disk]

    for i in range(READ_AHEAD):
        start_reads(i)
    try:
        for i in range(layout.num_layers):
            if i in pending:
                _wait_all(pending.pop(i))
            else:
                for j in disk:
                    read(i, j)
            start_reads(i + READ_AHEAD)
            for j, (item, src, sb) in enumerate(zip(plan, srcs, src_bytes, strict=True)):
                if src is None:
                    continue
                n = item.n_tokens
                stored = int(src.buf.shape[3])
                if paged is not None and n < stored <= paged.page_tokens:
                    # A chunk used in part: its whole stored layer, one contiguous source (a slice of pinned
                    # memory is staged through pageable memory, synchronously, on its way to a device).
                    # The page's tokens past n are the job's to overwrite; nothing reads past its length.
                    n = stored
                dst, dst_k, dst_v = destinations(i, j, n)
                if dst is not None:  # K and V of the layer in one copy
                    _copy(dst, src.buf[i, :, :, :n], sb[i, :, :, :n] if sb is not None else None)
                else:
                    _copy(dst_k, src.buf[i, 0, :, :n], sb[i, 0, :, :n] if sb is not None else None)
                    _copy(dst_v, src.buf[i, 1, :, :n], sb[i, 1, :, :n] if sb is not None else None)
            event = None
            if stream is not None:
                event = torch.cuda.Event(enable_timing=True)  # a timeline of the restore can place it
                event.record(stream)
            restored.mark_loaded(i, event)
    finally:
        for futures in pending.values():  # a failed load: nothing may still write once it is over
            for f in futures:
                f.exception()


def _byte_runs(rows: np.ndarray) -> list[np.ndarray]:
    """A destination's bytes as contiguous runs in order: the whole tensor when it is contiguous (a
    whole page's K or V), else one run per head (a chunk shorter than its page). One run per tensor is
    one iovec and one checksum update: python-xxhash holds the GIL over small updates, so per-head runs
    serialized the read threads' checksums (docs/benchmarks.md, "Tier throughput")."""
    return [rows.reshape(-1)] if rows.flags.c_contiguous else list(rows)


def _wait_all(futures: list[Future[None]]) -> None:
    """Every read done; the first failure (in plan order) raised once all have ended."""
    failure: BaseException | None = None
    for f in futures:
        exc = f.exception()
        if exc is not None and failure is None:
            failure = exc
    if failure is not None:
        raise failure


def other_bad_chunks(
    plan: list[PlanItem], failed_key: str, read_all: Callable[[str, ChunkMeta], object]
) -> list[tuple[str, Exception]]:
    """After a load failed on `failed_key`: every other chunk of the plan read from disk, verified whole
    (all layers against their checksums), and the ones that fail with why. The store drops them all at
    once, so the next turn (or the retry of this one) reuses the valid chunks before the first bad one
    instead of finding one more bad chunk per turn."""
    bad: list[tuple[str, Exception]] = []
    for item in plan:
        if item.mem is not None or item.key == failed_key or item.meta is None:
            continue
        try:
            read_all(item.key, item.meta)
        except Exception as e:  # CorruptChunk, or the file is gone or unreadable
            bad.append((item.key, e))
    return bad
