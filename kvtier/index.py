"""The prefix index: chunk entries by key, children by parent key, and the longest-prefix walk.

Pure bookkeeping, no I/O and no locking: the store holds its lock around every call. An entry says who
a chunk is and what the store as a whole knows of it (pins, prefetch); where its bytes are is the
tiers' business (tier_interface.py: each tier keeps its own handle per key).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from .chunk import ChunkId
from .chunk_keys import chunk_key


@dataclass(eq=False)
class Entry:
    """One stored chunk. Written only by PrefixIndex (below), under the store's lock; others read."""

    chunk: ChunkId
    nbytes: int
    pins: int = 0  # jobs using it: never evicted nor superseded while > 0
    removed: bool = False  # left the index (a later entry of the same key is another Entry)
    prefetched: bool = False  # brought up by a prefetch and not used by a job since

    @property
    def key(self) -> str:
        return self.chunk.key

    @property
    def n_tokens(self) -> int:
        return self.chunk.n_tokens


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
        # Keys by the (namespace, session) that stored them first (ChunkId.session): what a session's
        # retention covers without walking every entry (retention.py).
        self._sessions: dict[tuple[str, str], set[str]] = {}
        self.version = 0  # counts adds and removes: a view derived from the entries (retention) is stale

    def _session_of(self, entry: Entry) -> tuple[str, str] | None:
        session = entry.chunk.session
        return (entry.chunk.namespace, session) if session is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def add(self, entry: Entry) -> None:
        replaced = self._entries.get(entry.key)
        if replaced is not None and replaced is not entry:
            self._forget_session_key(replaced)
        self._entries[entry.key] = entry
        self._children.setdefault(entry.chunk.parent, set()).add(entry.key)
        session = self._session_of(entry)
        if session is not None:
            self._sessions.setdefault(session, set()).add(entry.key)
        self.version += 1

    def _forget_session_key(self, entry: Entry) -> None:
        session = self._session_of(entry)
        if session is None:
            return
        keys = self._sessions.get(session)
        if keys is not None:
            keys.discard(entry.key)
            if not keys:
                del self._sessions[session]

    def remove(self, key: str) -> Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.version += 1
            self._forget_session_key(entry)
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

    def session_entries(self, namespace: str, session: str) -> list[Entry]:
        """The entries this session stored first (their ChunkId.session is it)."""
        return [self._entries[k] for k in self._sessions.get((namespace, session), ())]

    # ---- what the store knows of an entry ---------------------------------------------------------

    @staticmethod
    def pin(entries: Iterable[Entry]) -> list[Entry]:
        """The one way to pin: a pinned entry is never evicted nor superseded until unpinned."""
        pinned = list(entries)
        for e in pinned:
            e.pins += 1
        return pinned

    @staticmethod
    def unpin(pinned: Iterable[Entry]) -> None:
        for e in pinned:
            e.pins -= 1

    @staticmethod
    def mark_prefetched(entry: Entry) -> None:
        entry.prefetched = True

    @staticmethod
    def take_prefetched(entry: Entry) -> bool:
        """Whether a prefetch brought the entry up and nothing used it since; clears that."""
        was, entry.prefetched = entry.prefetched, False
        return was


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
    usable: Callable[[Entry], bool],
) -> list[Step]:
    """Walk full chunks by key (token ids verified on every hit), then take the stored child of the last
    matched chunk with the longest common token prefix with what is left, using only that many tokens.

    `find` looks a key up, possibly adopting a file another process wrote (hence not index.get);
    `usable`: whether some tier (or a save in flight) holds the entry's bytes.
    """
    steps: list[Step] = []
    parent, pos, n = root, 0, len(token_ids)
    while pos + chunk_tokens <= n:
        toks = tuple(token_ids[pos : pos + chunk_tokens])
        entry = find(chunk_key(parent, toks))
        if (
            entry is None
            or not usable(entry)
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
            if usable(child) and child.chunk.namespace == namespace:
                common = common_prefix_len(child.chunk.token_ids, rest)
                if common > best_len:
                    best, best_len = child, common
        if best is not None:
            steps.append(Step(best, pos, best_len))
    return steps
