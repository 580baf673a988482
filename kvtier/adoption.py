"""Adoption of L2 files: the start-up scan (a restart keeps every conversation) and, later, files another
replica wrote to the shared disk, found by key. A corrupt file is quarantined, a foreign one (another
model or layout) left alone; neither is ever indexed.
"""

from __future__ import annotations

from pathlib import Path

from .chunk_files import chunk_path, read_header, scan
from .chunk_format import ChunkMeta, CorruptChunk, ForeignChunk
from .index import Entry
from .state import StoreState


def scan_folder(state: StoreState) -> None:
    """Index every valid file under the L2 root, oldest first so LRU order follows file age."""
    for path, _mtime in scan(state.root):
        meta = read_meta(state, path)
        if meta is not None:
            state.unlink(adopt(state, meta))


def adopt_key(state: StoreState, key: str) -> bool:
    """Adopt the file of `key` if one exists (one stat when it does not); True if the key is now usable."""
    path = chunk_path(state.root, key)
    if not path.exists():
        return False
    meta = read_meta(state, path)
    if meta is None:
        return False
    state.unlink(adopt(state, meta))
    with state.lock:
        entry = state.index.get(key)
        return entry is not None and entry.usable


def read_meta(state: StoreState, path: Path) -> ChunkMeta | None:
    """Header of a file, or None (foreign, missing, or quarantined because it is bad)."""
    try:
        return read_header(path, state.model_fingerprint, state.layout)
    except (ForeignChunk, FileNotFoundError):
        return None
    except CorruptChunk as e:
        state.quarantine(path, str(e))
        return None


def adopt(state: StoreState, meta: ChunkMeta) -> list[Path]:
    """Index a valid file (ours from before a restart, or another replica's). Returns files to delete
    (L2 victims that made room for it)."""
    deletes: list[Path] = []
    with state.lock:
        entry = state.index.get(meta.key)
        if entry is not None and (entry.on_disk or entry.pending is not None):
            return deletes
        if entry is None:
            entry = Entry(meta.chunk, state.nbytes(meta.n_tokens))
        if not state.placement.reserve_l2(entry, deletes):
            return deletes
        entry.on_disk, entry.meta = True, meta
        if state.index.get(meta.key) is None:
            state.index.add(entry)
    return deletes
