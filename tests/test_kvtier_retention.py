"""Retention (kvtier/retention.py): a retained session's chunks are evicted after every unretained one,
the earliest deadline first among retained ones; holds expire; a hold broken by pressure is counted once
and logged; stats say what is held. Time is the test's own clock: no test waits."""

from __future__ import annotations

import logging

import pytest

from kvtier import KVStore, StoreConfig
from kvtier.retention import Hold, Retention, retention_order

from .test_kvtier import CB, CHUNK, FP, LAYOUT, kv, toks


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path, clock: Clock, l0: int, l1: int = 0, l2: int = 100 * CB, share: float = 1.0) -> KVStore:
    """`share`: the most of a tier holds keep ahead of the rest (all of it unless a test is about that)."""
    cfg = StoreConfig(
        l0, l1, l2, tmp_path / "l2", chunk_tokens=CHUNK, async_save=False, retention_max_share=share
    )
    return KVStore(cfg, LAYOUT, FP, clock=clock)


def put(store: KVStore, session: str, base: int, n: int = CHUNK) -> list[int]:
    ids = toks(n, base)
    store.put("t", ids, kv(n, seed=base), session=session)
    return ids


def tier(store: KVStore, ids: list[int]) -> str | None:
    return store.lookup("t", ids, count=False).tier


def test_a_retained_session_is_demoted_after_every_unretained_one(tmp_path):
    clock = Clock()
    s = make(tmp_path, clock, l0=3 * CB, l1=100 * CB)
    a, b, c = put(s, "a", 0), put(s, "b", 100), put(s, "c", 200)
    s.retain("t", "a", 30)
    d = put(s, "d", 300)  # L0 is full: LRU alone would demote a (the least recently used)
    assert tier(s, a) == "l0" and tier(s, b) == "l1"
    e = put(s, "e", 400)
    assert tier(s, a) == "l0" and tier(s, c) == "l1"
    assert tier(s, d) == "l0" and tier(s, e) == "l0"
    st = s.stats()
    assert st.retention_evictions == 0
    assert st.retained_sessions == 1
    assert st.retained_bytes["l0"] == CB and st.retained_bytes["l1"] == 0
    assert st.retained_bytes["l2"] == CB  # its file, saved as every chunk is


def test_an_unretained_chunk_goes_down_a_tier_rather_than_push_a_hold_out(tmp_path):
    """Every L0 chunk is retained: a newcomer no hold keeps is placed in L1, and no hold is broken."""
    clock = Clock()
    s = make(tmp_path, clock, l0=2 * CB, l1=100 * CB)
    a, b = put(s, "a", 0), put(s, "b", 100)
    s.retain("t", "a", 100)
    s.retain("t", "b", 50)
    c = put(s, "c", 200)
    assert (tier(s, a), tier(s, b), tier(s, c)) == ("l0", "l0", "l1")
    assert s.stats().retention_evictions == 0


def test_holds_keep_at_most_their_share_of_a_tier_the_latest_deadlines_first(tmp_path):
    """Three sessions held in an L0 of 4 chunks whose holds may keep half: the two latest deadlines stay
    ahead of everyone, the earliest is ordered as any chunk (least recently used: it goes first), so a
    session that asked for nothing still finds room in L0."""
    clock = Clock()
    s = make(tmp_path, clock, l0=4 * CB, l1=100 * CB, share=0.5)
    a, b, c = put(s, "a", 0), put(s, "b", 100), put(s, "c", 200)
    s.retain("t", "a", 10)
    s.retain("t", "b", 30)
    s.retain("t", "c", 20)
    d = put(s, "d", 300)
    e = put(s, "e", 400)  # L0 is full: a goes, held past the share, the least recently used
    assert [tier(s, x) for x in (a, b, c, d, e)] == ["l1", "l0", "l0", "l0", "l0"]
    f = put(s, "f", 500)  # then d, never b or c
    assert [tier(s, x) for x in (b, c, d, e, f)] == ["l0", "l0", "l1", "l0", "l0"]
    st = s.stats()
    assert st.retention_evictions == 1 and st.retained_sessions == 3
    with pytest.raises(ValueError, match="retention_max_share"):
        StoreConfig(CB, 0, 0, tmp_path / "x", retention_max_share=0)


def test_among_retained_sessions_the_earliest_deadline_goes_first(tmp_path):
    """Where memory runs out (no slower memory tier: L1 of 0), a newcomer breaks the hold that ends first,
    whatever the order of use."""
    clock = Clock()
    s = make(tmp_path, clock, l0=2 * CB, l1=0)
    a, b = put(s, "a", 0), put(s, "b", 100)
    s.retain("t", "a", 100)  # a: least recently used, latest deadline
    s.retain("t", "b", 50)
    c = put(s, "c", 200)
    assert (tier(s, a), tier(s, b), tier(s, c)) == ("l0", "l2", "l0")
    st = s.stats()
    assert st.retention_evictions == 1 and st.retained_sessions == 2


def test_an_expired_hold_drops_out(tmp_path):
    clock = Clock()
    s = make(tmp_path, clock, l0=2 * CB, l1=100 * CB)
    a, b = put(s, "a", 0), put(s, "b", 100)
    s.retain("t", "a", 10)
    clock.now += 10.5
    assert s.stats().retained_sessions == 0
    put(s, "c", 200)  # plain LRU again: a goes, and no hold was broken
    assert tier(s, a) == "l1" and tier(s, b) == "l0"
    st = s.stats()
    assert st.retention_evictions == 0 and st.retained_bytes == {"l0": 0, "l1": 0, "l2": 0}


def test_pressure_breaking_a_hold_is_counted_once_and_logged(tmp_path, caplog):
    clock = Clock()
    s = make(tmp_path, clock, l0=2 * CB, l1=0)  # one memory tier: memory runs out in it
    a = put(s, "a", 0, n=2 * CHUNK)  # two chunks: all of L0
    s.retain("t", "a", 60)
    with caplog.at_level(logging.WARNING, logger="kvtier.placement"):
        put(s, "b", 100)  # L0 would run out: a retained chunk must go
        put(s, "c", 200)  # and its other one: the same hold, counted once
    assert s.stats().retention_evictions == 1
    assert tier(s, a) == "l2"
    lines = [r.getMessage() for r in caplog.records if "retention" in r.getMessage()]
    assert len(lines) == 1 and "session a" in lines[0]
    s.retain("t", "a", 120)  # a new, longer hold: breaking it counts again
    put(s, "d", 300)
    put(s, "e", 400)
    assert s.stats().retention_evictions == 1  # a's chunks left memory already: nothing of it breaks


def test_a_hold_covers_the_chain_its_session_continues_and_what_it_stores_later(tmp_path):
    clock = Clock()
    s = make(tmp_path, clock, l0=100 * CB, l1=100 * CB)
    system = put(s, "other", 0, n=2 * CHUNK)  # a shared prefix, tagged with the session that stored it
    s.put("t", system + toks(CHUNK, 500), kv(3 * CHUNK, seed=7), session="agent")
    s.retain("t", "agent", 30)
    assert s.stats().retained_bytes["l0"] == 3 * CB  # its own chunk and the two before it
    s.put("t", system + toks(2 * CHUNK, 500), kv(4 * CHUNK, seed=7), session="agent")  # its next turn
    assert s.stats().retained_bytes["l0"] == 4 * CB


def test_forgetting_a_session_ends_its_hold(tmp_path):
    s = make(tmp_path, Clock(), l0=100 * CB)
    put(s, "a", 0)
    s.retain("t", "a", 30)
    assert s.stats().retained_sessions == 1
    s.forget_session("t", "a")
    st = s.stats()
    assert st.retained_sessions == 0 and st.retained_bytes["l0"] == 0


def test_shedding_memory_takes_retained_chunks_last(tmp_path):
    clock = Clock()
    s = make(tmp_path, clock, l0=4 * CB)
    a, b = put(s, "a", 0), put(s, "b", 100)
    s.retain("t", "a", 30)
    assert s.shed_memory(CB) == CB  # one chunk's worth: b's, though a is the least recently used
    assert tier(s, a) == "l0" and tier(s, b) == "l2"
    assert s.shed_memory(CB) == CB
    assert tier(s, a) == "l2" and s.stats().retention_evictions == 1


def test_a_hold_is_never_shortened_and_must_be_positive(tmp_path):
    clock = Clock()
    r = Retention(clock)
    assert r.retain("t", "a", 60) == clock.now + 60
    assert r.retain("t", "a", 5) == clock.now + 60  # the longer hold stays
    assert r.retain("t", "a", 90) == clock.now + 90
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            r.retain("t", "a", bad)


def test_retention_order_moves_retained_keys_last_earliest_deadline_first():
    soon, later = Hold("t", "s", 10.0), Hold("t", "l", 20.0)
    retained = {"x": later, "y": soon, "z": later}
    assert retention_order(["x", "a", "y", "b", "z"], retained) == ["a", "b", "y", "x", "z"]
    assert retention_order(["x", "a"], {}) == ["x", "a"]
