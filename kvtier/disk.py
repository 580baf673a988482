"""L2 files: one safetensors file per chunk, written atomically, validated before anything is served.

File: `<root>/<key[:2]>/<key>.safetensors`, tensors `k.{layer}` / `v.{layer}` each [heads, n, head_dim]
(per layer, so a reader can hand out layer 0 while later layers still load), string metadata naming the
format version, model fingerprint, layout, namespace, parent key, token ids, session and checksums
(one xxh3 per token-id list, one per layer's K+V bytes), so a bit-flip reads as a miss, never as KV.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

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
    h = xxhash.xxh3_64()
    for t in (k, v):
        h.update(t.detach().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_chunk(
    root: Path, meta: ChunkMeta, data: ChunkKV, model_fingerprint: str, layout: KVLayout
) -> ChunkMeta:
    """Write atomically (temp file in the same folder, fsync, rename, fsync folder).

    Returns the metadata with the layer checksums filled in, which later reads verify against.
    """
    host = data.to(torch.device("cpu"))
    tensors: dict[str, torch.Tensor] = {}
    checksums = []
    for i, (k, v) in enumerate(zip(host.k, host.v, strict=True)):
        tensors[f"k.{i}"] = k.contiguous()
        tensors[f"v.{i}"] = v.contiguous()
        checksums.append(layer_checksum(k, v))
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
    path = chunk_path(root, meta.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{meta.key}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_path(path.parent, directory=True)
    return dataclasses.replace(meta, layer_checksums=tuple(checksums))


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
    """Reads one chunk file layer by layer, verifying each layer's checksum before handing it out."""

    def __init__(self, path: Path, meta: ChunkMeta) -> None:
        self._meta = meta
        self._cm = safe_open(str(path), framework="pt", device="cpu")
        try:
            self._f = self._cm.__enter__()
        except Exception as e:
            raise CorruptChunk(f"unreadable: {e}") from e

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            k = self._f.get_tensor(f"k.{i}")
            v = self._f.get_tensor(f"v.{i}")
        except Exception as e:
            raise CorruptChunk(f"layer {i} unreadable: {e}") from e
        if layer_checksum(k, v) != self._meta.layer_checksums[i]:
            raise CorruptChunk(f"layer {i} fails its checksum")
        return k, v

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def read_chunk(path: Path, meta: ChunkMeta, num_layers: int) -> ChunkKV:
    """All layers of a chunk, verified."""
    reader = ChunkReader(path, meta)
    try:
        pairs = [reader.layer(i) for i in range(num_layers)]
    finally:
        reader.close()
    return ChunkKV([k for k, _ in pairs], [v for _, v in pairs])


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
