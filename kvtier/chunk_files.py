"""L2 file operations: atomic writes and verified layer-wise reads. What a file must contain lives in
chunk_format.py; where it lives, temp names, quarantine and the scan in chunk_folder.py.

A write goes to a temp file in the chunk's folder, is fsynced and renamed, so a reader (or a restart)
sees a whole file or none.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from safetensors import safe_open

from .chunk import ChunkId, ChunkKV, SideStreams
from .chunk_folder import FILE_MODE, chunk_path, make_dirs, tmp_name
from .chunk_format import (
    MAX_HEADER_BYTES,
    ChunkMeta,
    CorruptChunk,
    check_metadata,
    check_tensors,
    file_metadata,
    header_bytes,
    tensor_offsets,
)
from .layout import KVLayout

# ---- writing -------------------------------------------------------------------------------------


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, parts: list[Any]) -> None:
    """Write every byte of `parts` (bytes-like objects) to fd; writev may write less than asked."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _libc_sync_file_range() -> Callable[[int], object] | None:
    """Linux sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE): start writing a file's dirty pages back
    now, without waiting. Only a head start for the fsync that follows (which alone gives durability)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd: fn(fd, 0, 0, 2)  # a failure only loses the head start


_start_writeback = _libc_sync_file_range()


@dataclass
class PendingWrite:
    """A chunk written to its temp file, not yet fsynced nor renamed (see write_chunks)."""

    meta: ChunkMeta
    tmp: Path
    path: Path
    fd: int


def _abort(fd: int, tmp: Path) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(OSError):
        tmp.unlink()


def _start_write(
    root: Path,
    chunk: ChunkId,
    data: ChunkKV,
    model_fingerprint: str,
    layout: KVLayout,
    staging: SideStreams | None = None,
) -> PendingWrite:
    """Checksum the chunk's layers and write header + buffer to a fresh temp file (not fsynced yet).
    A device chunk is staged in pinned memory first (on `staging`'s stream), its copy alone waited for."""
    host = data.to(torch.device("cpu"), pin=data.buf.is_cuda, streams=staging)
    data_bytes = host.host_bytes()
    assert data_bytes is not None  # a host buffer
    rows = data_bytes.reshape(host.buf.shape[0], -1)  # layer i's K then V bytes are row i
    meta = ChunkMeta(chunk, tuple(xxhash.xxh3_64_hexdigest(rows[i]) for i in range(rows.shape[0])))
    header = header_bytes(file_metadata(meta, model_fingerprint, layout), layout, chunk.n_tokens)
    path = chunk_path(root, chunk.key)
    make_dirs(path.parent)
    tmp = path.parent / tmp_name(chunk.key)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    try:
        _write_all(fd, [header, rows])
        if _start_writeback is not None:  # the disk starts on this chunk while we prepare the next
            _start_writeback(fd)
    except BaseException:
        _abort(fd, tmp)
        raise
    return PendingWrite(meta, tmp, path, fd)


def _finish_writes(
    started: list[tuple[int, PendingWrite]],
    results: list[ChunkMeta | OSError | None],
    drop_cache: bool = False,
) -> set[Path]:
    """fsync, close and rename each started write (popping it); returns the folders to fsync.
    `drop_cache`: once durable, drop the file's pages from the OS page cache (a later read is a disk read)."""
    folders: set[Path] = set()
    while started:
        j, w = started[0]
        try:
            os.fsync(w.fd)
            if drop_cache and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(w.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(w.fd)
            w.fd = -1
            os.replace(w.tmp, w.path)
        except OSError as e:
            _abort(w.fd, w.tmp)
            results[j] = e
        else:
            results[j] = w.meta
            folders.add(w.path.parent)
        started.pop(0)
    return folders


def write_chunks(
    root: Path,
    items: list[tuple[ChunkId, ChunkKV]],
    model_fingerprint: str,
    layout: KVLayout,
    drop_cache: bool = False,
    staging: SideStreams | None = None,
) -> list[ChunkMeta | OSError]:
    """Write several chunks atomically: each to a temp file in its folder, then fsync each, rename each,
    and fsync each folder touched once. Every file is durable under its final name before this returns.

    All files are written before the first fsync so the disk sees one stream of writes instead of one
    small flush per chunk, and a folder shared by several chunks is fsynced once. Per chunk: its
    metadata with layer checksums, or the OSError that stopped it (others still go on).
    """
    results: list[ChunkMeta | OSError | None] = [None] * len(items)
    started: list[tuple[int, PendingWrite]] = []
    try:
        for j, (chunk, data) in enumerate(items):
            try:
                started.append((j, _start_write(root, chunk, data, model_fingerprint, layout, staging)))
            except OSError as e:
                results[j] = e
        folders = _finish_writes(started, results, drop_cache)
    except BaseException:
        for _, w in started:
            _abort(w.fd, w.tmp)
        raise
    for folder in sorted(folders):
        try:
            _fsync_path(folder, directory=True)
        except OSError as e:  # the rename may not be durable: report every chunk in that folder
            for j, r in enumerate(results):
                if isinstance(r, ChunkMeta) and chunk_path(root, r.key).parent == folder:
                    results[j] = e
    return [r for r in results if r is not None]


# ---- reading -------------------------------------------------------------------------------------


def read_header(path: Path, model_fingerprint: str, layout: KVLayout) -> ChunkMeta:
    """Validate a file's header (not its tensor bytes). Raises CorruptChunk, ForeignChunk or
    FileNotFoundError."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            md = f.metadata() or {}
            names = set(f.keys())
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
            dtypes = {f.get_slice(name).get_dtype() for name in names}
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        raise CorruptChunk(f"unreadable: {e}") from e
    meta = check_metadata(md, path.name, model_fingerprint, layout)
    check_tensors(shapes, dtypes, meta.n_tokens, layout)
    return meta


class ChunkReader:
    """Reads one chunk file layer by layer with pread straight into the caller's buffers, and verifies
    each layer's checksum on those bytes (still in cache) before the caller may hand them out."""

    def __init__(self, path: Path, meta: ChunkMeta, layout: KVLayout) -> None:
        self._meta = meta
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise CorruptChunk(f"unreadable: {e}") from e
        try:
            self._offsets = self._read_offsets(layout)
        except BaseException:
            os.close(self._fd)
            raise

    def _read_offsets(self, layout: KVLayout) -> dict[str, int]:
        try:
            size = os.fstat(self._fd).st_size
            (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise CorruptChunk("header length out of range")
            header = json.loads(os.pread(self._fd, n, 8))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise CorruptChunk(f"unreadable header: {e}") from e
        return tensor_offsets(header, n, size, self._meta.n_tokens, layout)

    def _pread_into(self, dest: list[np.ndarray], offset: int) -> None:
        views = [memoryview(d).cast("B") for d in dest]  # type: ignore[arg-type]
        while views:
            n = os.preadv(self._fd, views, offset)
            if n <= 0:
                raise CorruptChunk("file shorter than its header says")
            offset += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]

    def read_layer_into(self, i: int, k_rows: list[np.ndarray], v_rows: list[np.ndarray]) -> None:
        """Read layer i's K and V into the given destinations (each a list of contiguous uint8 arrays that
        together hold the tensor's bytes in order, e.g. one per head), then verify the layer's checksum.
        Raises CorruptChunk (the destinations then hold unverified bytes: do not use them)."""
        try:
            self._pread_into(k_rows, self._offsets[f"k.{i}"])
            self._pread_into(v_rows, self._offsets[f"v.{i}"])
        except OSError as e:
            raise CorruptChunk(f"layer {i} unreadable: {e}") from e
        h = xxhash.xxh3_64()
        for r in (*k_rows, *v_rows):
            h.update(memoryview(r))  # type: ignore[arg-type]
        if h.hexdigest() != self._meta.layer_checksums[i]:
            raise CorruptChunk(f"layer {i} fails its checksum")

    def read_chunk_layer(self, i: int, chunk: ChunkKV) -> None:
        """Read layer i into a ChunkKV host buffer, verified."""
        rows = chunk.buf[i].view(torch.uint8).numpy().reshape(2, -1)
        self.read_layer_into(i, [rows[0]], [rows[1]])

    def close(self) -> None:
        os.close(self._fd)


def read_chunk(path: Path, meta: ChunkMeta, layout: KVLayout, *, pin: bool = False) -> ChunkKV:
    """All layers of a chunk, verified, in a new host ChunkKV (page-locked with `pin`)."""
    chunk = ChunkKV.empty(layout, meta.n_tokens, torch.device("cpu"), pin=pin)
    reader = ChunkReader(path, meta, layout)
    try:
        for i in range(layout.num_layers):
            reader.read_chunk_layer(i, chunk)
    finally:
        reader.close()
    return chunk
