"""Positional decoupling: after a truncation, reuse the kept turns' stored KV at their new positions.

The session's previous sequence (its last prompt + answer, whose chunks the session index names) held
the kept turns T positions further on, behind the turns now dropped. `find_realignment` lines the new
prompt up with it at token level: the common prefix (the system prompt) stays where it is, the run of
kept tokens that follows is found in the previous sequence wherever it starts (mid-chunk is fine), and
only what comes after it is prefilled. `ShiftedKV` restores that previous prefix through the store's
ordinary layer-wise load and, as each layer is first used, moves the kept run down by T positions: keys
rotated by -T (rope_shift), values copied. The moved KV saw the dropped turns when it was computed, so
the result is close to a recompute of the truncated text, not equal to it: the one declared exception to
exact reuse (X-AttentionStore-Position-Shift says T).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier import PrefixMatch

from .job_kv import JobKV, LayerSource
from .rope_shift import RopeShift


@dataclass(frozen=True)
class Realignment:
    """prompt[:keep] is previous[:keep] (reused in place); prompt[keep:keep+n] is previous[src:src+n]
    (reused, moved down by shift = src - keep positions)."""

    keep: int
    src: int
    n: int

    @property
    def shift(self) -> int:
        return self.src - self.keep

    @property
    def reused(self) -> int:
        return self.keep + self.n

    @property
    def source_end(self) -> int:
        """Tokens of the previous sequence the restore must cover."""
        return self.src + self.n

    def within(self, restorable: int) -> Realignment | None:
        """This alignment cut to the first `restorable` tokens of the previous sequence (what the store
        still holds); None when nothing is left to move."""
        n = min(self.n, restorable - self.src)
        if n <= 0 or restorable < self.keep:
            return None
        return Realignment(self.keep, self.src, n)


def _run(a: Sequence[int], i: int, b: Sequence[int], j: int) -> int:
    """Length of the common run of a[i:] and b[j:]."""
    n = 0
    while i + n < len(a) and j + n < len(b) and a[i + n] == b[j + n]:
        n += 1
    return n


def find_realignment(prompt: Sequence[int], previous: Sequence[int], probe: int = 4) -> Realignment | None:
    """Where the new prompt's tokens after its common prefix with `previous` sit in `previous` (the
    longest run, the earliest on ties). The prompt's last token is left out: it is always computed."""
    limit = len(prompt) - 1
    keep = _run(prompt[:limit], 0, previous, 0)
    if keep >= limit:
        return None
    want = list(prompt[keep:limit])
    head = want[: min(probe, len(want))]
    prev = list(previous)
    best: Realignment | None = None
    for src in range(keep + 1, len(prev) - len(head) + 1):
        if prev[src] != head[0] or prev[src : src + len(head)] != head:
            continue
        n = _run(want, 0, prev, src)
        if best is None or n > best.n:
            best = Realignment(keep, src, n)
            if n == len(want):
                break
    return best


def used_tokens_by_tier(match: PrefixMatch, found: Realignment) -> dict[str, int]:
    """Reused tokens per tier: only the parts of the restored chunks the prompt uses (the dropped turns in
    between are loaded, then overwritten)."""
    counts = dict.fromkeys(("l0", "l1", "l2"), 0)
    for c in match.chunks:
        for lo, hi in ((0, found.keep), (found.src, found.source_end)):
            counts[c.tier] += max(0, min(hi, c.start + c.n_tokens) - max(lo, c.start))
    return counts


# A move gathers at most this many bytes of keys and values at once. Where the restore is complete, the
# layers not moved yet go together, in a handful of operations instead of a handful per layer: on a small,
# busy CPU each operation is a parallel region that may wait for a core (docs/benchmarks.md, "Positional
# decoupling"). The bound keeps a long context's move from holding a second copy of its KV.
MOVE_BATCH_BYTES = 64 << 20


class ShiftedKV(LayerSource):
    """A restored previous sequence in a job's pages, each layer moved into place on first use (on the
    runner's thread, once per layer): [keep, keep + n) <- [src, src + n), keys rotated by -shift."""

    def __init__(self, restored: LayerSource, found: Realignment, rope: RopeShift, kv: JobKV) -> None:
        self._restored = restored
        self._found = found
        self._rope = rope
        self._kv = kv
        self._index: tuple[torch.Tensor, ...] | None = None
        self._matrix: torch.Tensor | None = None  # the move by -shift, made once for every layer
        self._done: set[int] = set()
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self._restored.ready

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(page, offset) of the moved tokens where they are and where they go, made once."""
        if self._index is None:
            f = self._found
            parts = (*self._kv.token_slots(f.src, f.source_end), *self._kv.token_slots(f.keep, f.reused))
            self._index = tuple(torch.tensor(p, dtype=torch.long, device=device) for p in parts)
        return self._index

    def wait_layer(self, i: int) -> None:
        self._restored.wait_layer(i)
        with self._lock:
            if i not in self._done:
                self._move(self._batch_from(i))

    def _batch_from(self, i: int) -> range:
        """The layers to move now: i, and after it those not moved yet while the restore has every layer
        in place and the batch stays within MOVE_BATCH_BYTES."""
        pool = self._kv.pool
        layers = pool.layout.num_layers
        if not self._restored.ready:
            return range(i, i + 1)
        per_layer = 2 * self._found.n * pool.layout.num_kv_heads * pool.layout.head_dim * pool.layout.itemsize
        end = min(layers, i + max(1, MOVE_BATCH_BYTES // max(1, per_layer)))
        for j in range(i + 1, end):
            if j in self._done:
                return range(i, j)
        return range(i, end)

    def _move(self, layers: range) -> None:
        """With the lock held: move `layers` (consecutive) in one gather, one product and one scatter."""
        buf = self._kv.pool.buffer[layers.start : layers.stop]  # [layers, pages, 2, heads, page, dim]
        src_pages, src_offsets, dst_pages, dst_offsets = self._indices(buf.device)
        if self._matrix is None:
            self._matrix = self._rope.matrix(-self._found.shift, buf.shape[-1]).to(buf.device)
        with torch.inference_mode():
            kv = buf[
                :, src_pages, :, :, src_offsets
            ]  # [tokens, layers, 2, heads, dim], a copy: runs may overlap
            keys = kv[:, :, 0]
            moved = torch.mm(keys.to(torch.float32).reshape(-1, keys.shape[-1]), self._matrix)
            keys.copy_(moved.view(keys.shape))
            buf[:, dst_pages, :, :, dst_offsets] = kv
        self._done.update(layers)


class ShiftStats:
    """Turns served with position-shifted KV, and the tokens moved (for the store's stats endpoint).

    Owned by the engine, counted by its jobs on the worker's thread (`count`), read from any thread
    (`snapshot`): its own lock guards both fields, so a reader never sees a turn without its tokens."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._turns = 0
        self._tokens = 0

    def count(self, tokens: int) -> None:
        with self._lock:
            self._turns += 1
            self._tokens += tokens

    def snapshot(self) -> tuple[int, int]:
        """(turns, tokens), read together."""
        with self._lock:
            return self._turns, self._tokens
