"""L2 files: one safetensors file per chunk, written atomically, validated before anything is served.

File: `<root>/<key[:2]>/<key>.safetensors`, tensors `k.{layer}` / `v.{layer}` each [heads, n, head_dim]
(per layer, so a reader can hand out layer 0 while later layers still load), stored back to back in the
order k.0, v.0, k.1, ... (the bytes of a ChunkKV buffer, written with one writev; any safetensors reader
reads the file, and files written by safetensors' own save_file read back too), string metadata naming the
format version, model fingerprint, layout, namespace, parent key, token ids, session and checksums
(one xxh3 per token-id list, one per layer's K+V bytes), so a bit-flip reads as a miss, never as KV.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash
from safetensors import safe_open

from .keys import FORMAT_VERSION, chunk_key, tokens_bytes
from .layout import KVLayout
from .tiers import ChunkKV

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
QUARANTINE = "quarantine"
FORMAT_NAME = "attnstore-kv"
STALE_TMP_SECONDS = 3600.0


class CorruptChunk(Exception):
    """A file that claims to be one of ours but cannot be trusted: quarantine it."""


class ForeignChunk(Exception):
    """A valid file of another model or layout on a shared disk: leave it alone, do not index it."""


@dataclass(frozen=True)
class ChunkMeta:
    """What the index needs to know about a chunk file, read from its header only."""

    key: str
    namespace: str
    parent: str
    token_ids: tuple[int, ...]
    session: str | None
    layer_checksums: tuple[str, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def chunk_path(root: Path, key: str) -> Path:
    return root / key[:2] / f"{key}{SUFFIX}"


def tokens_checksum(token_ids: tuple[int, ...]) -> str:
    return xxhash.xxh3_64_hexdigest(tokens_bytes(token_ids))


def layer_checksum(k: torch.Tensor, v: torch.Tensor) -> str:
    """xxh3 of layer's K bytes then V bytes (each in [heads, n, head_dim] order)."""
    h = xxhash.xxh3_64()
    for t in (k, v):
        h.update(t.detach().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def _byte_rows(buf: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a numpy uint8 array (no copy), first dimension kept; any dtype (bf16 too)."""
    return buf.view(torch.uint8).numpy().reshape(buf.shape[0], -1)


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, parts: list) -> None:
    """Write every byte of `parts` (bytes-like objects) to fd; writev may write less than asked."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _safetensors_header(metadata: dict[str, str], layout: KVLayout, n_tokens: int) -> bytes:
    """The safetensors header (length prefix + JSON, padded to 8 bytes) for tensors k.0, v.0, k.1, ...
    laid out back to back exactly as in a ChunkKV buffer; any safetensors reader reads the file."""
    shape = [layout.num_kv_heads, n_tokens, layout.head_dim]
    size = layout.num_kv_heads * n_tokens * layout.head_dim * layout.itemsize
    dtype = _safetensors_dtype(layout)
    header: dict[str, object] = {"__metadata__": metadata}
    off = 0
    for i in range(layout.num_layers):
        for kv in ("k", "v"):
            header[f"{kv}.{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + size]}
            off += size
    js = json.dumps(header, separators=(",", ":")).encode("utf-8")
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js


@dataclass
class PendingWrite:
    """A chunk written to its temp file, not yet fsynced nor renamed (see write_chunks)."""

    meta: ChunkMeta
    tmp: Path
    path: Path
    fd: int


def _start_write(
    root: Path, meta: ChunkMeta, data: ChunkKV, model_fingerprint: str, layout: KVLayout
) -> PendingWrite:
    """Checksum the chunk's layers and write header + buffer to a fresh temp file (not fsynced yet)."""
    host = data.to(torch.device("cpu"))
    rows = _byte_rows(host.buf)  # layer i's K then V bytes are row i: its checksum is one pass
    checksums = [xxhash.xxh3_64_hexdigest(rows[i]) for i in range(rows.shape[0])]
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "model_fingerprint": model_fingerprint,
        "layout": layout.describe(),
        "dtype": layout.dtype_name,
        "num_layers": str(layout.num_layers),
        "shape": json.dumps([layout.num_kv_heads, meta.n_tokens, layout.head_dim]),
        "key": meta.key,
        "namespace": meta.namespace,
        "parent": meta.parent,
        "token_ids": json.dumps(list(meta.token_ids)),
        "tokens_checksum": tokens_checksum(meta.token_ids),
        "layer_checksums": json.dumps(checksums),
        "session": meta.session or "",
    }
    header = _safetensors_header(metadata, layout, meta.n_tokens)
    path = chunk_path(root, meta.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{meta.key}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, [header, rows])
        if _start_writeback is not None:  # the disk starts on this chunk while we prepare the next
            _start_writeback(fd)
    except BaseException:
        _abort(fd, tmp)
        raise
    return PendingWrite(dataclasses.replace(meta, layer_checksums=tuple(checksums)), tmp, path, fd)


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


def _abort(fd: int, tmp: Path) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(OSError):
        tmp.unlink()


def write_chunks(
    root: Path,
    items: list[tuple[ChunkMeta, ChunkKV]],
    model_fingerprint: str,
    layout: KVLayout,
) -> list[ChunkMeta | OSError]:
    """Write several chunks atomically: each to a temp file in its folder, then fsync each, rename each,
    and fsync each folder touched once. Every file is durable under its final name before this returns.

    All files are written before the first fsync so the disk sees one stream of writes instead of one
    small flush per chunk, and a folder shared by several chunks is fsynced once. Per chunk: its
    metadata with layer checksums filled in, or the OSError that stopped it (others still go on).
    """
    results: list[ChunkMeta | OSError | None] = [None] * len(items)
    started: list[tuple[int, PendingWrite]] = []
    try:
        for j, (meta, data) in enumerate(items):
            try:
                started.append((j, _start_write(root, meta, data, model_fingerprint, layout)))
            except OSError as e:
                results[j] = e
        folders: set[Path] = set()
        while started:
            j, w = started[0]
            try:
                os.fsync(w.fd)
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
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def write_chunk(
    root: Path, meta: ChunkMeta, data: ChunkKV, model_fingerprint: str, layout: KVLayout
) -> ChunkMeta:
    """Write one chunk atomically (temp file in the same folder, fsync, rename, fsync folder).

    Returns the metadata with the layer checksums filled in, which later reads verify against.
    """
    (result,) = write_chunks(root, [(meta, data)], model_fingerprint, layout)
    if isinstance(result, OSError):
        raise result
    return result


def read_header(path: Path, model_fingerprint: str, layout: KVLayout) -> ChunkMeta:
    """Validate a file's header (not its tensor bytes). Raises CorruptChunk or ForeignChunk."""
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
    if md.get("format") != FORMAT_NAME:
        raise CorruptChunk(f"not an {FORMAT_NAME} file")
    if md.get("format_version") != str(FORMAT_VERSION):
        raise CorruptChunk(f"format version {md.get('format_version')!r}, expected {FORMAT_VERSION}")
    if md.get("model_fingerprint") != model_fingerprint or md.get("layout") != layout.describe():
        raise ForeignChunk(f"model {md.get('model_fingerprint')!r} layout {md.get('layout')!r}")
    try:
        token_ids = tuple(int(t) for t in json.loads(md["token_ids"]))
        checksums = tuple(str(c) for c in json.loads(md["layer_checksums"]))
        key, parent, namespace = md["key"], md["parent"], md["namespace"]
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptChunk(f"bad metadata: {e}") from e
    if not token_ids or md.get("tokens_checksum") != tokens_checksum(token_ids):
        raise CorruptChunk("token ids do not match their checksum")
    if path.name != f"{key}{SUFFIX}" or chunk_key(parent, token_ids) != key:
        raise CorruptChunk("file name, key and token ids disagree")
    n = len(token_ids)
    want = {f"{kv}.{i}" for i in range(layout.num_layers) for kv in ("k", "v")}
    shape = (layout.num_kv_heads, n, layout.head_dim)
    if names != want or any(s != shape for s in shapes.values()) or len(checksums) != layout.num_layers:
        raise CorruptChunk("tensor names or shapes do not match the layout")
    if dtypes != {_safetensors_dtype(layout)}:
        raise CorruptChunk(f"tensor dtypes {dtypes} do not match {layout.dtype_name}")
    return ChunkMeta(key, namespace, parent, token_ids, md.get("session") or None, checksums)


def _safetensors_dtype(layout: KVLayout) -> str:
    return {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[layout.dtype_name]


class ChunkReader:
    """Reads one chunk file layer by layer with pread straight into the caller's buffers, and verifies
    each layer's checksum on those bytes (still in cache) before the caller may hand them out."""

    def __init__(self, path: Path, meta: ChunkMeta, layout: KVLayout) -> None:
        self._meta = meta
        self._layout = layout
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise CorruptChunk(f"unreadable: {e}") from e
        try:
            self._offsets = self._read_offsets()
        except BaseException:
            os.close(self._fd)
            raise

    def _read_offsets(self) -> dict[str, int]:
        """Absolute file offset of every tensor, after checking the header against the indexed metadata
        (the file may have been replaced since it was indexed; the checksums still decide)."""
        try:
            size = os.fstat(self._fd).st_size
            (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            if n > min(size - 8, 100_000_000):
                raise CorruptChunk("header length out of range")
            header = json.loads(os.pread(self._fd, n, 8))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise CorruptChunk(f"unreadable header: {e}") from e
        lay, tokens = self._layout, self._meta.n_tokens
        want_shape = [lay.num_kv_heads, tokens, lay.head_dim]
        nbytes = lay.num_kv_heads * tokens * lay.head_dim * lay.itemsize
        offsets: dict[str, int] = {}
        for i in range(lay.num_layers):
            for kv in ("k", "v"):
                t = header.get(f"{kv}.{i}") if isinstance(header, dict) else None
                try:
                    start, end = (int(x) for x in t["data_offsets"])
                    ok = t["shape"] == want_shape and t["dtype"] == _safetensors_dtype(lay)
                except (TypeError, KeyError, ValueError) as e:
                    raise CorruptChunk(f"bad tensor entry {kv}.{i}") from e
                if not ok or end - start != nbytes or start < 0 or 8 + n + end > size:
                    raise CorruptChunk(f"tensor {kv}.{i} does not match the indexed chunk")
                offsets[f"{kv}.{i}"] = 8 + n + start
        return offsets

    def _pread_into(self, dest: list[np.ndarray], offset: int) -> None:
        views = [memoryview(d).cast("B") for d in dest]
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
        for r in k_rows:
            h.update(r)
        for r in v_rows:
            h.update(r)
        if h.hexdigest() != self._meta.layer_checksums[i]:
            raise CorruptChunk(f"layer {i} fails its checksum")

    def read_chunk_layer(self, i: int, chunk: ChunkKV) -> None:
        """Read layer i into a ChunkKV host buffer, verified."""
        rows = chunk.buf[i].view(torch.uint8).numpy().reshape(2, -1)
        self.read_layer_into(i, [rows[0]], [rows[1]])

    def close(self) -> None:
        os.close(self._fd)


def read_chunk(path: Path, meta: ChunkMeta, layout: KVLayout) -> ChunkKV:
    """All layers of a chunk, verified, in a new host ChunkKV."""
    chunk = ChunkKV.empty(layout, meta.n_tokens, torch.device("cpu"))
    reader = ChunkReader(path, meta, layout)
    try:
        for i in range(layout.num_layers):
            reader.read_chunk_layer(i, chunk)
    finally:
        reader.close()
    return chunk


def quarantine(root: Path, path: Path, reason: str) -> None:
    """Move a bad file aside (never delete evidence, never serve it)."""
    dest_dir = root / QUARANTINE
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest_dir / f"{path.name}.{uuid.uuid4().hex[:8]}")
        log.warning("kvtier: quarantined %s: %s", path, reason)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("kvtier: could not quarantine %s (%s): %s", path, reason, e)


def scan(root: Path) -> Iterator[tuple[Path, float]]:
    """Chunk files under root (not the quarantine), oldest first by mtime; removes stale temp files."""
    found: list[tuple[Path, float]] = []
    now = time.time()
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root and QUARANTINE in dirnames:
            dirnames.remove(QUARANTINE)
        for name in filenames:
            p = Path(dirpath) / name
            try:
                mtime = p.stat().st_mtime
            except FileNotFoundError:
                continue
            if name.endswith(TMP_SUFFIX):
                if now - mtime > STALE_TMP_SECONDS:  # a crashed write; a fresh one may be another replica's
                    with contextlib.suppress(OSError):
                        p.unlink()
            elif name.endswith(SUFFIX):
                found.append((p, mtime))
    found.sort(key=lambda pm: pm[1])
    yield from found
