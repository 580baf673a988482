"""The prefix index: chunk entries by key, children by parent key, and the longest-prefix walk.

Pure bookkeeping, no I/O and no locking: the store holds its lock around every call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from .chunk import ChunkId, ChunkKV
from .chunk_format import ChunkMeta
from .chunk_keys import chunk_key
from .tiers import Tier


@dataclass(eq=False)
class Entry:
    """One stored chunk (its identity) and where its bytes are right now. Mutated under the store lock."""

    chunk: ChunkId
    nbytes: int
    data: ChunkKV | None = None  # the L0 or L1 copy (possibly still on its old device, see placement)
    mem_tier: Tier | None = None  # "l0" | "l1" | None
    pending: ChunkKV | None = None  # the copy an L2 save in flight holds
    on_disk: bool = False
    meta: ChunkMeta | None = None  # header of the L2 file (layer checksums) once written or adopted
    pins: int = 0
    removed: bool = field(default=False)
    prefetched: bool = False  # brought up by a prefetch and not used by a job since

    @property
    def key(self) -> str:
        return self.chunk.key

    @property
    def n_tokens(self) -> int:
        return self.chunk.n_tokens

    @property
    def usable(self) -> bool:
        return self.data is not None or self.pending is not None or self.on_disk

    @property
    def tier(self) -> Tier:
        """Where a load would read it from (a save in flight counts as L2: it is L2's write buffer)."""
        return self.mem_tier if self.data is not None and self.mem_tier else "l2"


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixIndex:
    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._children: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def add(self, entry: Entry) -> None:
        self._entries[entry.key] = entry
        self._children.setdefault(entry.chunk.parent, set()).add(entry.key)

    def remove(self, key: str) -> Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.removed = True
            siblings = self._children.get(entry.chunk.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[entry.chunk.parent]
        return entry

    def children(self, parent: str) -> list[Entry]:
        return [self._entries[k] for k in self._children.get(parent, ())]

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))


@dataclass(frozen=True)
class Step:
    entry: Entry
    start: int
    n_tokens: int


def longest_prefix(
    index: PrefixIndex,
    root: str,
    namespace: str,
    token_ids: Sequence[int],
    chunk_tokens: int,
    find: Callable[[str], Entry | None],
) -> list[Step]:
    """Walk full chunks by key (token ids verified on every hit), then take the stored child of the last
    matched chunk with the longest common token prefix with what is left, using only that many tokens.

    `find` looks a key up, possibly adopting a file another process wrote (hence not index.get).
    """
    steps: list[Step] = []
    parent, pos, n = root, 0, len(token_ids)
    while pos + chunk_tokens <= n:
        toks = tuple(token_ids[pos : pos + chunk_tokens])
        entry = find(chunk_key(parent, toks))
        if (
            entry is None
            or not entry.usable
            or entry.chunk.token_ids != toks
            or entry.chunk.namespace != namespace
        ):
            break
        steps.append(Step(entry, pos, chunk_tokens))
        parent, pos = entry.key, pos + chunk_tokens
    if pos < n:
        rest = token_ids[pos:]
        best, best_len = None, 0
        for child in index.children(parent):
            if child.usable and child.chunk.namespace == namespace:
                common = common_prefix_len(child.chunk.token_ids, rest)
                if common > best_len:
                    best, best_len = child, common
        if best is not None:
            steps.append(Step(best, pos, best_len))
    return steps
