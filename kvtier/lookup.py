"""Lookups: the longest stored prefix of a turn's token ids, and the tokens of a stored chain of keys.

A key the index does not know may name a chunk another replica stored in the shared persistent tier:
it is adopted (one stat, outside the lock) before the walk goes on. A counted lookup touches its chunks
(recently used), and counts a hit of its slowest tier or a miss.
"""

from __future__ import annotations

from collections.abc import Sequence

from .adoption import Adoption
from .config import ChunkRef, PrefixMatch
from .core import StoreCore
from .index import Entry, Step, longest_prefix
from .placement import Placement


class Lookups:
    def __init__(self, core: StoreCore, placement: Placement, adoption: Adoption) -> None:
        self._core = core
        self._placement = placement
        self._adoption = adoption

    def lookup(
        self, root: str, namespace: str, token_ids: list[int], hint_keys: Sequence[str], count: bool
    ) -> PrefixMatch:
        """See KVStore.lookup; `root`: the namespace's root key."""
        core = self._core
        for key in hint_keys:
            with core.lock:
                known = core.index.get(key) is not None
            if not known:
                self._adoption.adopt_key(key)
        tried: set[str] = set()
        missing: list[str] = []

        def find(key: str) -> Entry | None:
            entry = core.index.get(key)
            if entry is None and key not in tried:
                missing.append(key)
            return entry

        while True:
            missing.clear()
            with core.lock:
                steps = longest_prefix(
                    core.index, root, namespace, token_ids, core.config.chunk_tokens, find, core.usable
                )
                if not missing:
                    return self._finish(namespace, steps, count)
            tried.add(missing[0])
            self._adoption.adopt_key(missing[0])  # another replica's file: one stat, outside the lock

    def _finish(self, namespace: str, steps: list[Step], count: bool) -> PrefixMatch:
        """With the lock held: the match, its chunks touched (recently used), and the hit counted."""
        core = self._core
        chunks = tuple(ChunkRef(st.entry.key, st.start, st.n_tokens, core.tier_of(st.entry)) for st in steps)
        match = PrefixMatch(namespace, sum(st.n_tokens for st in steps), chunks)
        self._placement.touch_chain([st.entry for st in steps])
        for st, ref in zip(steps, chunks, strict=True):
            if count:
                core.counters.chunk_matched(ref.tier, st.n_tokens)
                in_memory = core.memory_tier_of(st.entry.key) is not None
                if core.index.take_prefetched(st.entry) and in_memory:
                    core.counters.prefetch_was_used()
        if count:
            core.counters.lookup(match.tier)
        return match

    def chain_tokens(self, root: str, namespace: str, keys: Sequence[str]) -> list[int]:
        """See KVStore.chain_tokens; `root`: the namespace's root key."""
        core = self._core
        tokens: list[int] = []
        parent = root
        for key in keys:
            with core.lock:
                entry = core.index.get(key)
            if entry is None and self._adoption.adopt_key(key):
                with core.lock:
                    entry = core.index.get(key)
            with core.lock:
                chunk = entry.chunk if entry is not None and core.usable(entry) else None
            if chunk is None or chunk.namespace != namespace or chunk.parent != parent:
                break
            tokens.extend(chunk.token_ids)
            parent = key
        return tokens
