"""The store's seams: a tier backend of one's own plugs in without touching the others, and the eviction
policy is chosen per tier by the `eviction` setting (LRU, LFU), within the scheduler's order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch

from kvtier import Schedule, StoreConfig
from kvtier.chunk import ChunkId, ChunkKV
from kvtier.chunk_format import ChunkMeta, CorruptChunk
from kvtier.config import EVICTION_POLICIES
from kvtier.eviction import LeastFrequentlyUsed, Usage, make_policy
from kvtier.layout import KVLayout
from kvtier.memory_tier import HostTier
from kvtier.persistent_tier import PersistentTier
from kvtier.schedule import eviction_order
from tests.test_kvtier import CB, CHUNK, LAYOUT, assert_restored, kv, make, own, toks

# ---- a persistent tier of the test's own: chunks kept in a dict ("the shelf"), not in files --------


class ShelfReader:
    """Reads a shelved chunk layer by layer (the LayerReader interface)."""

    def __init__(self, data: ChunkKV) -> None:
        self._rows = data.buf.view(torch.uint8).numpy()  # [layers, 2, heads, n, head_dim * itemsize]

    def read_layer_into(self, i: int, k_rows: list[np.ndarray], v_rows: list[np.ndarray]) -> None:
        for kv_index, dests in ((0, k_rows), (1, v_rows)):
            src = self._rows[i, kv_index].reshape(-1)
            offset = 0
            for d in dests:
                flat = d.reshape(-1)
                flat[:] = src[offset : offset + flat.size]
                offset += flat.size

    def read_chunk_layer(self, i: int, chunk: ChunkKV) -> None:
        chunk.buf[i].view(torch.uint8).numpy()[:] = self._rows[i]

    def close(self) -> None:
        pass


class ShelfTier(PersistentTier):
    """L2 as a dict shared by every store built on the same `shelf` (a restart, a second replica)."""

    shelf: dict[str, tuple[ChunkMeta, ChunkKV]]

    @classmethod
    def from_config(cls, config: StoreConfig, layout: KVLayout, model_fingerprint: str) -> ShelfTier:
        return cls("l2", config.l2_capacity_bytes, make_policy("lru"))

    def write(self, items: Sequence[tuple[ChunkId, ChunkKV]]) -> list[ChunkMeta | OSError]:
        written: list[ChunkMeta | OSError] = []
        for chunk, data in items:
            meta = ChunkMeta(chunk, ("",) * LAYOUT.num_layers)
            self.shelf[chunk.key] = (meta, ChunkKV(data.buf.clone()))
            written.append(meta)
        return written

    def reader(self, key: str, meta: ChunkMeta) -> ShelfReader:
        if key not in self.shelf:
            raise FileNotFoundError(key)
        return ShelfReader(self.shelf[key][1])

    def read_all(self, key: str, meta: ChunkMeta, *, pin: bool = False) -> ChunkKV:
        return ChunkKV(self.shelf[key][1].buf.clone().pin_memory() if pin else self.shelf[key][1].buf.clone())

    def find(self, key: str) -> ChunkMeta | CorruptChunk | None:
        found = self.shelf.get(key)
        return found[0] if found is not None else None

    def scan(self) -> Iterator[ChunkMeta | CorruptChunk]:
        return iter([meta for meta, _ in self.shelf.values()])

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.shelf.pop(key, None)

    def quarantine(self, key: str, reason: str) -> None:
        self.shelf.pop(key, None)


def test_a_persistent_tier_of_ones_own_serves_restarts_and_replicas(tmp_path):
    shelf: dict[str, tuple[ChunkMeta, ChunkKV]] = {}
    tiers = {"l2": own(ShelfTier, shelf=shelf)}
    layers = kv(10, seed=7)
    store = make(tmp_path, l0=CB, l1=CB, l2=10 * CB, tiers=tiers)
    replica = make(tmp_path, l0=0, l1=0, l2=10 * CB, tiers=tiers)  # started before anything was stored
    keys = store.put("t", toks(10), layers, session="s")
    assert set(shelf) == set(keys) and not (tmp_path / "l2").exists()  # nothing went to a file
    m = store.lookup("t", toks(10))
    assert m.tokens == 10 and m.tokens_by_tier()["l2"] > 0  # memory held one chunk each, the rest L2
    assert_restored(store, m, layers, 10)
    m = replica.lookup("t", toks(10), hint_keys=keys)  # adopted by key (find), as a shared disk's files
    assert m.tokens == 10 and m.tier == "l2"
    assert_restored(replica, m, layers, 10)
    store.close()
    restarted = make(tmp_path, l0=0, l1=0, l2=10 * CB, tiers=tiers)  # scan() finds what is stored
    assert restarted.stats().tiers["l2"].entries == 3
    m = restarted.lookup("t", toks(10))
    assert m.tokens == 10 and m.tier == "l2"
    assert_restored(restarted, m, layers, 10)
    assert restarted.forget_session("t", "s") == 3 and shelf == {}


def test_a_full_shelf_evicts_its_least_recently_used_chunk(tmp_path):
    shelf: dict[str, tuple[ChunkMeta, ChunkKV]] = {}
    store = make(tmp_path, l0=0, l1=0, l2=2 * CB, tiers={"l2": own(ShelfTier, shelf=shelf)})
    for base in (0, 100):
        store.put("t", toks(CHUNK, base), kv(CHUNK, seed=base))
    assert store.lookup("t", toks(CHUNK, 0)).tokens == CHUNK  # 100 is now the least recently used
    store.put("t", toks(CHUNK, 200), kv(CHUNK, seed=2))
    assert [store.lookup("t", toks(CHUNK, b)).tokens for b in (0, 100, 200)] == [CHUNK, 0, CHUNK]
    assert len(shelf) == 2 and store.stats().evictions_by_tier["l2"] == 1


# ---- eviction policies ----------------------------------------------------------------------------


def _usage(key: str, last_used: int, uses: int) -> Usage:
    return Usage(key, nbytes=1, admitted=0, last_used=last_used, uses=uses)


def test_lfu_orders_by_uses_then_recency_and_follows_the_schedule():
    candidates = [_usage("a", 1, 3), _usage("b", 2, 0), _usage("c", 3, 1), _usage("d", 4, 0)]  # LRU order
    assert list(LeastFrequentlyUsed().order(candidates)) == ["b", "d", "c", "a"]
    policy = make_policy("lfu")
    assert list(policy.order(candidates)) == ["b", "d", "c", "a"]
    schedule = Schedule.from_queue(running=[["b"]], queue=[["c"], ["a"]], window=1)  # b, c protected
    assert eviction_order(policy.order(candidates), schedule) == ["d", "a"]  # unscheduled, then the queue


def test_a_tier_applies_the_schedule_to_its_policys_order_once():
    """The policy orders, the schedule reorders and leaves the protected out; pins are the store's."""
    tier = HostTier("l1", 4, make_policy("lfu"), torch.device("cpu"))
    for key in "abcd":
        tier.admit(key, 1, None)
    tier.touch("a")  # a used once: LFU gives it up last
    assert tier.ordered(None) == ["b", "c", "d", "a"]
    schedule = Schedule.from_queue(running=[["b"]], queue=[["c"], ["d"]], window=1)  # b, c protected
    assert tier.ordered(schedule) == ["a", "d"]
    assert tier.victims(2, lambda key: key != "a", schedule) is None  # a pinned: only d may go
    assert tier.victims(1, lambda key: True, None) == ["b"]


def test_an_unknown_policy_is_refused():
    assert set(EVICTION_POLICIES) == {"lru", "lfu"}
    with pytest.raises(ValueError, match="mru"):
        make_policy("mru")


@pytest.mark.parametrize(("policy", "evicted"), [("lru", 0), ("lfu", 100)])
def test_the_eviction_setting_chooses_what_a_full_tier_gives_up(tmp_path, policy, evicted):
    """A chunk reused by many lookups (0) and a one-off chunk put after it (100): LRU gives up the often
    used one because its last use is older; LFU gives up the one nobody reused."""
    store = make(tmp_path, l0=0, l1=3 * CB, l2=0, l1_eviction=policy)
    store.put("t", toks(CHUNK, 0), kv(CHUNK, seed=0))
    for _ in range(3):
        assert store.lookup("t", toks(CHUNK, 0)).tier == "l1"
    store.put("t", toks(CHUNK, 100), kv(CHUNK, seed=1))
    store.put("t", toks(CHUNK, 200), kv(CHUNK, seed=2))
    assert store.lookup("t", toks(CHUNK, 200)).tier == "l1"
    store.put("t", toks(CHUNK, 300), kv(CHUNK, seed=3))  # L1 is full: one chunk goes
    kept = {base: store.lookup("t", toks(CHUNK, base), count=False).tokens for base in (0, 100, 200, 300)}
    assert kept == {b: (0 if b == evicted else CHUNK) for b in (0, 100, 200, 300)}
    assert store.stats().evictions_by_tier["l1"] == 1
    store.close()


def test_l0_takes_its_own_policy_and_demotes_its_victim(tmp_path):
    store = make(tmp_path, l0=2 * CB, l1=4 * CB, l2=0, l0_eviction="lfu", l1_eviction="lru")
    store.put("t", toks(CHUNK, 0), kv(CHUNK, seed=0))
    store.lookup("t", toks(CHUNK, 0))
    store.put("t", toks(CHUNK, 100), kv(CHUNK, seed=1))
    store.put("t", toks(CHUNK, 200), kv(CHUNK, seed=2))  # L0 full: LFU demotes 100, not 0
    tiers = {b: store.lookup("t", toks(CHUNK, b), count=False).tier for b in (0, 100, 200)}
    assert tiers == {0: "l0", 100: "l1", 200: "l0"}
    store.close()
