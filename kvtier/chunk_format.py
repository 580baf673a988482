"""The L2 file format: what a chunk file's header says and how it is checked. No file I/O here
(chunk_files.py reads and writes); only bytes and dicts in, metadata or an exception out.

A file is plain safetensors: tensors `k.{layer}` / `v.{layer}` each [heads, n, head_dim] (per layer, so a
reader can hand out layer 0 while later layers still load), stored back to back in the order k.0, v.0,
k.1, ... (the bytes of a ChunkKV buffer; files written by safetensors' own save_file read back too), and
string metadata naming the format version, model fingerprint, layout, the chunk's identity and checksums
(one xxh3 per token-id list, one per layer's K+V bytes), so a bit-flip reads as a miss, never as KV.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import xxhash

from .chunk import ChunkId
from .chunk_keys import FORMAT_VERSION, chunk_key, tokens_bytes
from .layout import KVLayout

SUFFIX = ".safetensors"
FORMAT_NAME = "attnstore-kv"
MAX_HEADER_BYTES = 100_000_000


class CorruptChunk(Exception):
    """A file that claims to be one of ours but cannot be trusted: quarantine it."""


class ForeignChunk(Exception):
    """A valid file of another model or layout on a shared disk: leave it alone, do not index it."""


@dataclass(frozen=True)
class ChunkMeta:
    """What a chunk file's header promises: the chunk's identity and each layer's K+V checksum, which
    every later read verifies against."""

    chunk: ChunkId
    layer_checksums: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.chunk.key

    @property
    def n_tokens(self) -> int:
        return self.chunk.n_tokens


def tokens_checksum(token_ids: tuple[int, ...]) -> str:
    return xxhash.xxh3_64_hexdigest(tokens_bytes(token_ids))


def safetensors_dtype(layout: KVLayout) -> str:
    return {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[layout.dtype_name]


def file_metadata(meta: ChunkMeta, model_fingerprint: str, layout: KVLayout) -> dict[str, str]:
    """The string metadata a chunk file carries (safetensors allows strings only)."""
    c = meta.chunk
    return {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "model_fingerprint": model_fingerprint,
        "layout": layout.describe(),
        "dtype": layout.dtype_name,
        "num_layers": str(layout.num_layers),
        "shape": json.dumps([layout.num_kv_heads, c.n_tokens, layout.head_dim]),
        "key": c.key,
        "namespace": c.namespace,
        "parent": c.parent,
        "token_ids": json.dumps(list(c.token_ids)),
        "tokens_checksum": tokens_checksum(c.token_ids),
        "layer_checksums": json.dumps(list(meta.layer_checksums)),
        "session": c.session or "",
    }


def header_bytes(metadata: dict[str, str], layout: KVLayout, n_tokens: int) -> bytes:
    """The safetensors header (length prefix + JSON, padded to 8 bytes) for tensors k.0, v.0, k.1, ...
    laid out back to back exactly as in a ChunkKV buffer; any safetensors reader reads the file."""
    shape = [layout.num_kv_heads, n_tokens, layout.head_dim]
    size = layout.num_kv_heads * n_tokens * layout.head_dim * layout.itemsize
    dtype = safetensors_dtype(layout)
    header: dict[str, object] = {"__metadata__": metadata}
    off = 0
    for i in range(layout.num_layers):
        for kv in ("k", "v"):
            header[f"{kv}.{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + size]}
            off += size
    js = json.dumps(header, separators=(",", ":")).encode("utf-8")
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js


def check_metadata(
    md: Mapping[str, str], file_name: str, model_fingerprint: str, layout: KVLayout
) -> ChunkMeta:
    """The chunk a file's metadata describes, after checking format, model, checksums and that the key
    is the hash of parent and tokens (and the file's name). Raises CorruptChunk or ForeignChunk."""
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
    if file_name != f"{key}{SUFFIX}" or chunk_key(parent, token_ids) != key:
        raise CorruptChunk("file name, key and token ids disagree")
    if len(checksums) != layout.num_layers:
        raise CorruptChunk("one checksum per layer expected")
    return ChunkMeta(ChunkId(key, namespace, parent, token_ids, md.get("session") or None), checksums)


def check_tensors(
    shapes: Mapping[str, tuple[int, ...]], dtypes: set[str], n_tokens: int, layout: KVLayout
) -> None:
    """Tensor names, shapes and dtypes of a file against the layout. Raises CorruptChunk."""
    want = {f"{kv}.{i}" for i in range(layout.num_layers) for kv in ("k", "v")}
    shape = (layout.num_kv_heads, n_tokens, layout.head_dim)
    if set(shapes) != want or any(s != shape for s in shapes.values()):
        raise CorruptChunk("tensor names or shapes do not match the layout")
    if dtypes != {safetensors_dtype(layout)}:
        raise CorruptChunk(f"tensor dtypes {dtypes} do not match {layout.dtype_name}")


def tensor_offsets(
    header: object, header_len: int, file_size: int, n_tokens: int, layout: KVLayout
) -> dict[str, int]:
    """Absolute file offset of every tensor from a parsed safetensors header, checked against the indexed
    chunk (the file may have been replaced since it was indexed; the checksums still decide)."""
    want_shape = [layout.num_kv_heads, n_tokens, layout.head_dim]
    nbytes = layout.num_kv_heads * n_tokens * layout.head_dim * layout.itemsize
    offsets: dict[str, int] = {}
    for i in range(layout.num_layers):
        for kv in ("k", "v"):
            t = header.get(f"{kv}.{i}") if isinstance(header, dict) else None
            try:
                start, end = (int(x) for x in t["data_offsets"])  # type: ignore[index]
                ok = t["shape"] == want_shape and t["dtype"] == safetensors_dtype(layout)  # type: ignore[index]
            except (TypeError, KeyError, ValueError) as e:
                raise CorruptChunk(f"bad tensor entry {kv}.{i}") from e
            if not ok or end - start != nbytes or start < 0 or 8 + header_len + end > file_size:
                raise CorruptChunk(f"tensor {kv}.{i} does not match the indexed chunk")
            offsets[f"{kv}.{i}"] = 8 + header_len + start
    return offsets
