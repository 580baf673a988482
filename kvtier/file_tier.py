"""L2: one safetensors file per chunk under a folder, local or shared by replicas (chunk_files.py
does the file I/O, chunk_folder.py the folder's layout, chunk_format.py says what a file must hold)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .chunk import ChunkId, ChunkKV, SideStreams
from .chunk_files import ChunkReader, read_chunk, read_header, write_chunks
from .chunk_folder import chunk_path, make_dirs, quarantine, scan, tmp_name
from .chunk_format import ChunkMeta, CorruptChunk, ForeignChunk
from .config import StoreConfig
from .eviction import EvictionPolicy, make_policy
from .layout import KVLayout
from .persistent_tier import PersistentTier
from .tier_names import Tier


class FileTier(PersistentTier):
    """Chunk files under `root` (created owner-only). `drop_page_cache`: once a file is durable, its
    pages leave the OS page cache, so reading it back is a disk read."""

    def __init__(
        self,
        name: Tier,
        capacity_bytes: int,
        policy: EvictionPolicy,
        root: Path,
        layout: KVLayout,
        model_fingerprint: str,
        drop_page_cache: bool = False,
    ) -> None:
        super().__init__(name, capacity_bytes, policy)
        self.root = Path(root)
        self.layout = layout
        self.model_fingerprint = model_fingerprint
        self.drop_page_cache = drop_page_cache
        self._staging = SideStreams()  # device chunks copied to host before they are written
        self._unlinks = ThreadPoolExecutor(1, thread_name_prefix="kvtier-unlink")
        make_dirs(self.root)

    @classmethod
    def from_config(cls, config: StoreConfig, layout: KVLayout, model_fingerprint: str) -> FileTier:
        policy = make_policy("lru")  # L2 has no eviction setting: least recently used files go
        return cls(
            "l2",
            config.l2_capacity_bytes,
            policy,
            config.l2_path,
            layout,
            model_fingerprint,
            config.drop_page_cache,
        )

    def path(self, key: str) -> Path:
        return chunk_path(self.root, key)

    def write(self, items: Sequence[tuple[ChunkId, ChunkKV]]) -> list[ChunkMeta | OSError]:
        return write_chunks(
            self.root, list(items), self.model_fingerprint, self.layout, self.drop_page_cache, self._staging
        )

    def reader(self, key: str, meta: ChunkMeta) -> ChunkReader:
        return ChunkReader(self.path(key), meta, self.layout)

    def read_all(self, key: str, meta: ChunkMeta, *, pin: bool = False) -> ChunkKV:
        return read_chunk(self.path(key), meta, self.layout, pin=pin)

    def find(self, key: str) -> ChunkMeta | CorruptChunk | None:
        path = self.path(key)
        return self._header(path) if path.exists() else None  # one stat when there is none

    def scan(self) -> Iterator[ChunkMeta | CorruptChunk]:
        for path, _mtime in scan(self.root):
            found = self._header(path)
            if found is not None:
                yield found

    def delete(self, keys: Sequence[str]) -> None:
        """Each file is renamed to a temp name in its folder at once (its chunk is gone from then on: a
        new save of the key writes a file of its own) and unlinked on a thread of this tier: unlinking a
        chunk's file frees its blocks and its cached pages, far slower than a rename (docs/tiering.md),
        and a put evicting L2 files must not wait for that. A temp name left by a crash is removed by a
        later scan (chunk_folder.is_stale_tmp)."""
        doomed: list[Path] = []
        for key in keys:
            path = self.path(key)
            trash = path.parent / tmp_name(key)
            with contextlib.suppress(FileNotFoundError):
                os.rename(path, trash)
                doomed.append(trash)
        if not doomed:
            return
        try:
            self._unlinks.submit(_unlink_all, doomed)
        except RuntimeError:  # the tier is closing: here, then
            _unlink_all(doomed)

    def close(self) -> None:
        self._unlinks.shutdown(wait=True)

    def quarantine(self, key: str, reason: str) -> None:
        quarantine(self.root, self.path(key), reason)

    def _header(self, path: Path) -> ChunkMeta | CorruptChunk | None:
        """A file's header, None (another model's, or gone), or why it was quarantined."""
        try:
            return read_header(path, self.model_fingerprint, self.layout)
        except (ForeignChunk, FileNotFoundError):
            return None
        except CorruptChunk as e:
            quarantine(self.root, path, str(e))
            return e


def _unlink_all(paths: Sequence[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
