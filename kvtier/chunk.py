"""What one chunk is: its identity (ChunkId, shared by the index and the L2 file header) and its K/V bytes
(ChunkKV, one contiguous buffer)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .layout import KVLayout


class SideStreams:
    """The CUDA side streams of one owner (a tier's moves, a load thread's restores, the saves' staging):
    taken once per device (and per thread with `per_thread`) and kept.

    Why kept: `torch.cuda.Stream()` creates nothing, it hands out torch's pooled streams in turn (32 per
    priority), so a stream taken per copy is whatever stream another copy took 32 takes ago, and a
    restore would queue behind an unrelated copy that waits for the compute. `priority` -1: the high
    priority pool, for copies a step waits for (restores); such streams never meet the others."""

    def __init__(self, *, priority: int = 0, per_thread: bool = False) -> None:
        self._priority = priority
        self._lock = threading.Lock()
        self._shared: dict[torch.device, torch.cuda.Stream] = {}
        self._local = threading.local() if per_thread else None

    def get(self, device: torch.device) -> torch.cuda.Stream:
        """This owner's stream on a CUDA device (this thread's with `per_thread`)."""
        if device.index is None:  # "cuda" and "cuda:0" are one device, one stream
            device = torch.device("cuda", torch.cuda.current_device())
        streams = self._shared
        if self._local is not None:
            streams = self._local.__dict__.setdefault("streams", {})
        stream = streams.get(device)
        if stream is None:
            with self._lock:
                stream = streams.setdefault(device, torch.cuda.Stream(device, priority=self._priority))
        return stream


@dataclass(frozen=True)
class ChunkId:
    """Who a chunk is: its chained key, the tenant it belongs to, its parent key and its token ids, plus
    the session that first stored it (for stats and forgetting). The index entry and the file header
    both carry one, so the two can never disagree on what a chunk is."""

    key: str
    namespace: str
    parent: str
    token_ids: tuple[int, ...]
    session: str | None

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def host_bytes(t: torch.Tensor) -> np.ndarray | None:
    """A host tensor's bytes as a uint8 numpy array with the same dimensions (the last one scaled by the
    item size), no copy; None on a device or when the last dimension is not contiguous."""
    if t.device.type != "cpu" or (t.dim() and t.stride(-1) != 1) or t.requires_grad:
        return None
    return t.view(torch.uint8).numpy()


class ChunkKV:
    """K and V of every layer for one chunk, in ONE contiguous buffer [layers, 2, heads, n_tokens, head_dim]
    (K of layer i at buf[i, 0], V at buf[i, 1]). Never mutated once built, so readers may keep using a
    buffer while the store moves the chunk to another tier.

    One buffer means one allocation and one free per chunk, and the L2 file's tensor bytes are exactly
    this buffer's bytes (k.0, v.0, k.1, v.1, ...), so a save is one write and a layer's checksum one pass.

    `written`: on CUDA, the event recorded on the stream that filled the buffer, after its copies. The
    copies may still be running on the device when the store already holds the chunk, so whoever reads
    the buffer on another stream (a restore's copy stream, a demotion) waits on it first, and a host
    buffer filled from the device is read on the host only once its event has completed (`host_bytes`
    waits for it: for that copy alone, never for the rest of the device's work).
    """

    __slots__ = ("buf", "written")

    def __init__(self, buf: torch.Tensor, written: torch.cuda.Event | None = None) -> None:
        if buf.dim() != 5 or buf.shape[1] != 2 or not buf.is_contiguous():
            raise ValueError(
                f"ChunkKV needs a contiguous [layers, 2, heads, n, dim] buffer, got {tuple(buf.shape)}"
            )
        self.buf = buf
        self.written = written

    @classmethod
    def empty(cls, layout: KVLayout, n_tokens: int, device: torch.device, *, pin: bool = False) -> ChunkKV:
        """A host buffer to fill from the CPU (a disk read); see chunk_buffer for device buffers."""
        return cls(chunk_buffer(layout, n_tokens, device, pin=pin))

    @property
    def n_tokens(self) -> int:
        return int(self.buf.shape[3])

    def host_bytes(self) -> np.ndarray | None:
        """The buffer as a uint8 numpy array [layers, 2, heads, n, head_dim * itemsize] (no copy), or None
        off the host; a host buffer still being filled from the device is waited for first. numpy copies
        of these slices are memcpy-speed, and uint8 covers every dtype, bfloat16 included."""
        if self.written is not None and self.buf.device.type == "cpu":
            self.written.synchronize()
        return host_bytes(self.buf)

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    def to(self, device: torch.device, *, pin: bool = False, streams: SideStreams | None = None) -> ChunkKV:
        """Copy to `device` (none if it is there already, pinned where `pin` asks it to be); pinned host
        memory when asked.

        A copy to or from CUDA never waits: it runs on a side stream (the caller's `streams`, else one of
        torch's pooled ones), after the copies that wrote this buffer (`written`), and the result
        carries the event after it (a device result is read on other streams after that event, a host
        result once it has completed: `host_bytes`). The source stays allocated to that stream until
        the copy is done, even if its owner drops it meanwhile. Host to host copies are plain copies."""
        if self.buf.device == device and not (pin and device.type == "cpu" and not self.buf.is_pinned()):
            return self
        on = self.buf.device if self.buf.is_cuda else device
        if on.type != "cuda":
            out = torch.empty_like(self.buf, device=device, pin_memory=pin and device.type == "cpu")
            np_src, np_out = self.host_bytes(), host_bytes(out)
            if np_src is not None and np_out is not None:
                np.copyto(np_out, np_src)
            else:
                out.copy_(self.buf)
            return ChunkKV(out)
        stream = streams.get(on) if streams is not None else torch.cuda.Stream(on)
        with torch.cuda.stream(stream):
            if self.written is not None:
                stream.wait_event(self.written)
            out = torch.empty_like(self.buf, device=device, pin_memory=pin and device.type == "cpu")
            out.copy_(self.buf, non_blocking=True)
            if self.buf.is_cuda:
                self.buf.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return ChunkKV(out, event)


def chunk_buffer(layout: KVLayout, n_tokens: int, device: torch.device, *, pin: bool = False) -> torch.Tensor:
    shape = (layout.num_layers, 2, layout.num_kv_heads, n_tokens, layout.head_dim)
    return torch.empty(shape, dtype=layout.dtype, device=device, pin_memory=pin)


def record_written(device: torch.device) -> torch.cuda.Event | None:
    """On CUDA, an event on the current stream after the copies enqueued so far; None elsewhere."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def copy_blocks(
    blocks: Sequence[torch.Tensor], todo: Sequence[int], device: torch.device
) -> dict[int, ChunkKV]:
    """Chunks given as chunk-shaped blocks ([layers, 2, heads, n, head_dim] each, e.g. a paged pool's
    pages) copied into buffers of their own on `device`, one copy per chunk. On CUDA the copies run on
    the caller's current stream; each chunk carries the event after them."""
    bufs: dict[int, torch.Tensor] = {}
    for i in todo:
        src = blocks[i]
        buf = torch.empty(src.shape, dtype=src.dtype, device=device)
        dst_bytes, src_bytes = host_bytes(buf), host_bytes(src)
        if dst_bytes is not None and src_bytes is not None:
            np.copyto(dst_bytes, src_bytes)
        else:
            buf.copy_(src, non_blocking=True)
        bufs[i] = buf
    written = record_written(device)
    return {i: ChunkKV(b, written) for i, b in bufs.items()}


def copy_blocks_to_host(
    blocks: Sequence[torch.Tensor], todo: Sequence[int], stream: torch.cuda.Stream
) -> tuple[dict[int, ChunkKV], torch.cuda.Event]:
    """CUDA blocks copied straight into pinned host buffers on `stream`, after the work the caller's
    current stream holds so far (what wrote them), so the caller's stream never waits for these copies.
    Returns the chunks (each carries the event after the copies) and that event: the blocks are read
    until it completes, so their memory must not be written again before it."""
    device = blocks[todo[0]].device
    before = torch.cuda.Event()
    before.record(torch.cuda.current_stream(device))
    bufs: dict[int, torch.Tensor] = {}
    with torch.cuda.stream(stream):
        stream.wait_event(before)
        for i in todo:
            src = blocks[i]
            bufs[i] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            bufs[i].copy_(src, non_blocking=True)  # a strided page: torch packs it on `stream` first
            src.record_stream(stream)  # a caller that drops its block leaves the memory to these reads
        read = torch.cuda.Event()
        read.record(stream)
    return {i: ChunkKV(b, read) for i, b in bufs.items()}, read


def copy_chunks(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    spans: dict[int, tuple[int, int]],
    layout: KVLayout,
    device: torch.device,
) -> dict[int, ChunkKV]:
    """The caller's K/V sliced into chunk buffers on `device`: one allocation per chunk, then every
    layer's K and V slice copied in, layer by layer (each source tensor is read once, front to back).
    On CUDA the copies run on the caller's current stream; each chunk carries the event after them."""
    bufs = {i: chunk_buffer(layout, e - s, device) for i, (s, e) in spans.items()}
    dst_bytes = {i: host_bytes(b) for i, b in bufs.items()}
    for li, (k, v) in enumerate(pairs):
        for kv, src in enumerate((k, v)):
            src_bytes = host_bytes(src)
            for i, (s, e) in spans.items():
                dst = dst_bytes[i]
                if src_bytes is not None and dst is not None:
                    np.copyto(dst[li, kv], src_bytes[:, s:e])
                else:
                    bufs[i][li, kv].copy_(src[:, s:e])
    written = record_written(device)
    return {i: ChunkKV(b, written) for i, b in bufs.items()}
