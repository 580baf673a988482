"""The connector's arithmetic, free of vLLM and torch: what a request asks for, how many of its tokens the
store can supply beyond vLLM's own cache, where those tokens sit in vLLM's paged blocks, and which tier
each came from. Everything here is plain data, so the unit tests run it without vLLM or a model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# vLLM's own prefix cache (its paged KV memory) is tier l0; the store below it supplies l1 and l2.
VLLM_TIER = "l0"
PARAMS_KEY = (
    "attnstore"  # kv_transfer_params = {"attnstore": {"tenant", "session", "turn", "reuse", "hints"}}
)
DEFAULT_NAMESPACE = "default"  # requests that name no tenant (vLLM used without the proxy)


@dataclass(frozen=True)
class TurnParams:
    """What a request tells the connector through its kv_transfer_params."""

    namespace: str  # the tenant: its KV is never matched for another
    session: str | None = None  # names the conversation, so it can be forgotten
    turn: str | None = None  # the proxy's id for this request: the store reports under it
    reuse: bool = True  # False: compute everything (a recompute to compare with), still save
    # Chunk keys another replica stored for this session (its session index record): the store adopts
    # them from the shared L2 before it looks, so a partial last chunk written there is found too.
    hints: tuple[str, ...] = ()


def parse_params(kv_transfer_params: Mapping[str, Any] | None, cache_salt: str | None = None) -> TurnParams:
    """The request's attnstore parameters. Without them the namespace follows vLLM's own isolation: the
    request's cache_salt when it has one, else one shared default namespace."""
    raw = (kv_transfer_params or {}).get(PARAMS_KEY)
    if not isinstance(raw, Mapping):
        return TurnParams(f"salt:{cache_salt}" if cache_salt else DEFAULT_NAMESPACE)

    def text(name: str) -> str | None:
        value = raw.get(name)
        return value if isinstance(value, str) and value else None

    return TurnParams(
        namespace=text("tenant") or DEFAULT_NAMESPACE,
        session=text("session"),
        turn=text("turn"),
        reuse=raw.get("reuse", True) is not False,
        hints=tuple(k for k in raw.get("hints") or () if isinstance(k, str)),
    )


def check_chunk_size(chunk_tokens: int, block_size: int) -> None:
    """A stored chunk must cover whole vLLM blocks, so a chunk boundary is always a block boundary."""
    if chunk_tokens <= 0 or block_size <= 0 or chunk_tokens % block_size:
        raise ValueError(
            f"chunk_tokens {chunk_tokens} must be a positive multiple of vLLM's block size {block_size}"
        )


def external_tokens(stored: int, prompt_tokens: int, local: int) -> int:
    """Tokens the store supplies beyond the `local` ones vLLM's own cache has. At least one prompt token
    is always computed (its logits give the first answer token), so a match stops one short of the end."""
    return max(0, min(stored, prompt_tokens - 1) - local)


@dataclass(frozen=True)
class StoredChunk:
    """One chunk of a store match as the scheduler sees it: where it starts, its tokens, its tier."""

    start: int
    n_tokens: int
    tier: str

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


def tokens_by_tier(chunks: Iterable[StoredChunk], start: int, end: int) -> dict[str, int]:
    """How many of the tokens in [start, end) each tier holds."""
    counts: dict[str, int] = {}
    for c in chunks:
        overlap = min(c.end, end) - max(c.start, start)
        if overlap > 0:
            counts[c.tier] = counts.get(c.tier, 0) + overlap
    return counts


def first_seen_tiers(first: Sequence[StoredChunk], now: Sequence[StoredChunk]) -> list[StoredChunk]:
    """The chunks of the current match labelled with the tier each was in when the request arrived
    (before a prefetch moved it up): the tier the turn actually had to reach, the one it reports."""
    seen = {(c.start, c.n_tokens): c.tier for c in first}
    return [StoredChunk(c.start, c.n_tokens, seen.get((c.start, c.n_tokens), c.tier)) for c in now]


def covering_chunks(chunks: Sequence[StoredChunk], start: int, end: int) -> tuple[list[int], int]:
    """(indexes of the chunks a load of [start, end) reads, in order; offset of `start` in the first).
    A load reads whole chunks from the first one holding `start`; [start, end) is taken out of them."""
    picked = [i for i, c in enumerate(chunks) if c.end > start and c.start < end]
    return picked, (start - chunks[picked[0]].start if picked else 0)


def block_slots(
    start: int, end: int, block_ids: Sequence[int], block_size: int
) -> tuple[list[int], list[int]]:
    """For each token position in [start, end): its vLLM block id and its offset in that block."""
    if end > len(block_ids) * block_size:
        raise ValueError(f"tokens up to {end} need more than the {len(block_ids)} blocks given")
    positions = range(start, end)
    return [block_ids[p // block_size] for p in positions], [p % block_size for p in positions]


def blocks_of(start: int, end: int, block_ids: Sequence[int], block_size: int) -> set[int]:
    """The block ids holding any token of [start, end)."""
    if end <= start:
        return set()
    return set(block_ids[start // block_size : (end - 1) // block_size + 1])


_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(layer_name: str) -> int:
    """The decoder layer number in a vLLM attention layer name ("model.layers.12.self_attn.attn" -> 12)."""
    found = _LAYER_INDEX.search(layer_name)
    if found is None:
        raise ValueError(f"no layer number in the attention layer name {layer_name!r}")
    return int(found.group(1))


def ordered_layers(layer_names: Iterable[str]) -> list[str]:
    """Attention layer names in layer order; each layer number once (the store keeps one KV per layer)."""
    names = sorted(layer_names, key=layer_index)
    numbers = [layer_index(n) for n in names]
    if numbers != list(range(len(names))):
        raise ValueError(f"attention layers are not numbered 0..{len(names) - 1}: {numbers}")
    return names


@dataclass(frozen=True)
class LoadSpec:
    """Scheduler -> worker: restore tokens [start, end) of `token_ids` into the request's blocks."""

    req_id: str
    namespace: str
    token_ids: tuple[int, ...]  # the prompt up to `end`
    start: int
    end: int
    block_ids: tuple[int, ...]
    turn: str | None = None


@dataclass(frozen=True)
class SaveSpec:
    """Scheduler -> worker: a finished request's computed tokens to store from its (still held) blocks."""

    req_id: str
    namespace: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    session: str | None = None
    turn: str | None = None


@dataclass
class StepPlan:
    """Everything the worker does for the connector in one engine step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
