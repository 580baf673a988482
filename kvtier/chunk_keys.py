"""Chained chunk keys: key_0 names (format, model, layout, tenant); key_i = H(key_{i-1}, tokens of chunk i).

A key therefore names a whole prefix, so a walk over the hashes finds the longest stored prefix, and two
tenants (namespaces) or two models can never produce the same key.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

FORMAT_VERSION = 1


def root_key(model_fingerprint: str, layout_desc: str, namespace: str) -> str:
    """The parent of a namespace's first chunk."""
    text = f"attnstore-kv\0{FORMAT_VERSION}\0{model_fingerprint}\0{layout_desc}\0{namespace}"
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def tokens_bytes(token_ids: Sequence[int]) -> bytes:
    """Canonical byte form of token ids (int64 little-endian), used by keys and checksums."""
    return np.asarray(token_ids, dtype="<i8").tobytes()


def chunk_key(parent: str, token_ids: Sequence[int]) -> str:
    h = xxhash.xxh3_128()
    h.update(parent.encode("ascii"))
    h.update(tokens_bytes(token_ids))
    return h.hexdigest()


def chunk_spans(n_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk covering n tokens; only the last may be shorter than chunk_tokens."""
    return [(s, min(s + chunk_tokens, n_tokens)) for s in range(0, n_tokens, chunk_tokens)]


def chain(root: str, token_ids: Sequence[int], chunk_tokens: int) -> list[str]:
    """Keys of every chunk covering token_ids, in order."""
    keys: list[str] = []
    parent = root
    for s, e in chunk_spans(len(token_ids), chunk_tokens):
        parent = chunk_key(parent, token_ids[s:e])
        keys.append(parent)
    return keys
