"""Layer-wise restore: a load thread assembles each layer's K and V from the match's chunks, in layer
order, into a RestoredKV (restored_kv.py), so the runner can compute layer i while layer i+1 is still
being read from disk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .chunk import ChunkKV, host_bytes
from .chunk_format import ChunkMeta
from .layout import KVLayout
from .persistent_tier import LayerReader
from .restored_kv import RestoredKV

OpenReader = Callable[[str, ChunkMeta], LayerReader]
"""Opens a stored chunk for layer-wise reads (the persistent tier's `reader`)."""


@dataclass
class PlanItem:
    """One chunk of a load: read from memory (`mem`) or from the persistent tier (`meta`)."""

    key: str
    n_tokens: int
    mem: ChunkKV | None = None
    meta: ChunkMeta | None = None
    buf: ChunkKV | None = None  # host buffer for a disk chunk (to promote, to move to a device, or partial)


class LoadFailure(Exception):
    def __init__(self, item: PlanItem, cause: BaseException) -> None:
        super().__init__(f"chunk {item.key}: {cause}")
        self.item = item
        self.cause = cause


def run_load(
    plan: list[PlanItem], restored: RestoredKV, layout: KVLayout, open_reader: OpenReader
) -> dict[str, ChunkKV]:
    """Fill `restored` layer by layer. Returns {key: ChunkKV} of the chunks read from disk into host
    buffers (to promote). A disk chunk without a buffer (`buf`) is read straight into the output and
    checksummed there, before that layer is handed out.

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
        device = restored.target(0)[0].device
        # On CUDA the host-to-device copies run on a stream of their own, one event per layer, so layer
        # i+1 copies while the model computes layer i on its stream (the paper's layer-wise pre-loading).
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        try:
            if stream is not None:
                _order_copy_stream(stream, restored, layout, srcs)
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with ctx:
                _fill_layers(plan, restored, layout, readers, srcs, src_bytes, stream)
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
    for i in range(layout.num_layers):
        for t in restored.target(i):
            if t.is_cuda:
                t.record_stream(stream)


def _fill_layers(
    plan: list[PlanItem],
    restored: RestoredKV,
    layout: KVLayout,
    readers: dict[str, LayerReader],
    srcs: list[ChunkKV | None],
    src_bytes: list[np.ndarray | None],
    stream: torch.cuda.Stream | None,
) -> None:
    """run_load's layer loop: each layer from every chunk of the plan, then handed to readers."""
    for i in range(layout.num_layers):
        out_k, out_v = restored.target(i)
        ok, ov = host_bytes(out_k[0]), host_bytes(out_v[0])
        pos = 0
        for item, src, sb in zip(plan, srcs, src_bytes, strict=True):
            n = item.n_tokens
            if item.mem is None:
                reader = readers[item.key]
                try:
                    if item.buf is not None:
                        reader.read_chunk_layer(i, item.buf)
                    else:  # whole chunk used, host output: read it in place, verify it there
                        assert ok is not None and ov is not None
                        reader.read_layer_into(
                            i,
                            [ok[h, pos : pos + n] for h in range(ok.shape[0])],
                            [ov[h, pos : pos + n] for h in range(ov.shape[0])],
                        )
                except Exception as e:
                    raise LoadFailure(item, e) from e
            if src is not None:
                if sb is not None and ok is not None and ov is not None:
                    np.copyto(ok[:, pos : pos + n], sb[i, 0, :, :n])
                    np.copyto(ov[:, pos : pos + n], sb[i, 1, :, :n])
                else:
                    out_k[0, :, pos : pos + n].copy_(src.buf[i, 0, :, :n], non_blocking=True)
                    out_v[0, :, pos : pos + n].copy_(src.buf[i, 1, :, :n], non_blocking=True)
            pos += n
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        restored.mark_loaded(i, event)


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
