"""kvtier's threads and lock: load threads owned and joined by close(), tensor copies made without the
store lock, RestoredKV's fail/settle handshake, prefetch. Every wait is on an event, never a timer
(the timeouts only bound a failure)."""

from __future__ import annotations

import threading
from typing import get_args

import pytest
import torch

from kvtier import TIERS, KVLoadError, RestoredKV, Tier
from kvtier.chunk import ChunkKV
from kvtier.chunk_files import ChunkReader
from kvtier.chunk_format import ChunkMeta
from kvtier.file_tier import FileTier
from kvtier.memory_tier import DeviceTier
from tests.test_kvtier import CB, LAYOUT, kv, make, own, toks

BOUND = 10  # seconds before a wait counts as a failure; a passing run never waits this long


def test_tier_names_are_one_type():
    assert TIERS == get_args(Tier) == ("l0", "l1", "l2")


class GatedReadTier(FileTier):
    """L2 whose reads wait for `release` once they have said so (`entered`), noting the reading thread."""

    entered: threading.Event
    release: threading.Event
    readers: list[threading.Thread]

    def reader(self, key: str, meta: ChunkMeta) -> ChunkReader:
        self.readers.append(threading.current_thread())
        self.entered.set()
        self.release.wait()
        return super().reader(key, meta)


class GatedCopyTier(DeviceTier):
    """L0 whose first copy onto its device waits for `release` once it has said so (`entered`)."""

    entered: threading.Event
    release: threading.Event

    def copy_in(self, data: ChunkKV) -> ChunkKV:
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait()
        return super().copy_in(data)


def test_close_waits_for_loads_in_flight(tmp_path):
    entered, release = threading.Event(), threading.Event()
    load_threads: list[threading.Thread] = []
    gated = own(GatedReadTier, entered=entered, release=release, readers=load_threads)
    s = make(tmp_path, l0=0, l1=0, tiers={"l2": gated})  # L2 only: the load reads the file
    layers = kv(8)
    s.put("t", toks(8), layers)
    m = s.lookup("t", toks(8))
    r = s.load(m)
    assert entered.wait(BOUND)
    closer = threading.Thread(target=s.close)
    closer.start()
    release.set()
    closer.join()
    assert not load_threads[0].is_alive()  # close() returned only once the load thread had ended
    r.wait()
    for i, (k, v) in enumerate(layers):
        rk, rv = r.layer(i)
        assert torch.equal(rk, k) and torch.equal(rv, v)
    with pytest.raises(KVLoadError, match="closed"):  # no thread starts after close
        s.load(m).wait()


@pytest.mark.parametrize("when", ["put", "promote"])
def test_copies_run_without_the_store_lock(tmp_path, when):
    """While a chunk is copied to its tier's device (put, or promotion after a load from L2), stats()
    and lookup() still answer: the copy does not hold the lock."""
    layers = kv(8)
    entered, release = threading.Event(), threading.Event()
    gated = {"l0": own(GatedCopyTier, entered=entered, release=release)}
    if when == "promote":
        writer = make(tmp_path, l0=100 * CB, l1=0)
        writer.put("t", toks(8), layers)
        writer.close()
    s = make(tmp_path, l0=100 * CB, l1=0, tiers=gated)  # promote: restarted, the chunks are in L2 only
    if when == "promote":
        assert s.lookup("t", toks(8)).tier == "l2"

    def work() -> None:
        if when == "put":
            s.put("t", toks(8), layers)
        else:
            s.load(s.lookup("t", toks(8))).wait()

    worker = threading.Thread(target=work)
    worker.start()
    answered = threading.Event()
    try:
        assert entered.wait(BOUND)

        def ask() -> None:
            s.stats()
            s.lookup("t", toks(8), count=False)
            answered.set()

        threading.Thread(target=ask, daemon=True).start()
        assert answered.wait(BOUND), "stats() waited for a copy: the copy holds the store lock"
    finally:
        release.set()
    worker.join()
    m = s.lookup("t", toks(8))
    assert m.tokens == 8 and m.tier == "l0"
    r = s.load(m)
    for i, (k, v) in enumerate(layers):
        assert torch.equal(r.layer(i)[0], k) and torch.equal(r.layer(i)[1], v)
    r.wait()
    s.close()


def test_restored_kv_fail_wakes_readers_and_keeps_loaded_layers():
    r = RestoredKV(4, LAYOUT, torch.device("cpu"), capacity=6)
    k, v = r.target(0)
    assert k.shape == (1, LAYOUT.num_kv_heads, 6, LAYOUT.head_dim)
    k.fill_(1.0)
    v.fill_(2.0)
    r.mark_loaded(0)
    errors: list[BaseException] = []

    def read_layer_1() -> None:
        try:
            r.layer(1)
        except KVLoadError as e:
            errors.append(e)

    reader = threading.Thread(target=read_layer_1)
    reader.start()  # blocks: layer 1 is not loaded
    r.fail(KVLoadError("chunk gone"))
    reader.join()
    assert [str(e) for e in errors] == ["chunk gone"]
    rk, rv = r.layer(0)  # a layer handed out before the failure stays valid
    assert rk.shape[2] == 4 and bool((rk == 1).all()) and bool((rv == 2).all())
    r.settle()
    with pytest.raises(KVLoadError, match="chunk gone"):
        r.wait()


def test_restored_kv_wait_returns_once_loaded_and_settled():
    r = RestoredKV(3, LAYOUT, torch.device("cpu"))
    done = threading.Event()

    def waiter() -> None:
        r.wait()
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    for i in range(LAYOUT.num_layers):
        r.target(i)[0].zero_()
        r.target(i)[1].zero_()
        r.mark_loaded(i)
    r.settle()
    t.join()
    assert done.is_set()
    assert r.layer(LAYOUT.num_layers - 1)[0].shape == (1, LAYOUT.num_kv_heads, 3, LAYOUT.head_dim)


def test_empty_restored_kv_is_settled_at_once():
    r = RestoredKV(0, LAYOUT, torch.device("cpu"), capacity=5)
    r.wait()
    assert r.buffers(0)[0].shape[2] == 5 and r.layer(0)[0].shape[2] == 0


def test_load_of_a_forgotten_chunk_fails_and_settles(tmp_path):
    s = make(tmp_path)
    s.put("t", toks(8), kv(8), session="s1")
    m = s.lookup("t", toks(8))
    assert s.forget_session("t", "s1") == 2
    with pytest.raises(KVLoadError, match="no longer stored"):
        s.load(m).wait()
    assert s.stats().load_errors == 1
    s.close()


def test_prefetch_brings_l2_chunks_into_l1(tmp_path):
    layers = kv(8)
    s = make(tmp_path, l0=0, l1=100 * CB)
    s.put("t", toks(8), layers)
    s.close()
    s = make(tmp_path, l0=0, l1=100 * CB)
    m = s.lookup("t", toks(8))
    assert m.tier == "l2"
    s.prefetch(m)
    s.close()  # joins the prefetch thread
    m = s.lookup("t", toks(8))
    assert m.tier == "l1" and s.stats().tiers["l1"].entries == 2
    r = s.load(m)  # close() stopped the load threads: the load fails cleanly
    with pytest.raises(KVLoadError):
        r.wait()


def test_a_mixed_match_is_labelled_by_its_slowest_tier():
    from kvtier import ChunkRef, PrefixMatch

    match = PrefixMatch(
        "ns", 48, (ChunkRef("a", 0, 16, "l0"), ChunkRef("b", 16, 16, "l2"), ChunkRef("c", 32, 16, "l1"))
    )
    assert match.tier == "l2"
    assert match.tokens_by_tier() == {"l0": 16, "l1": 16, "l2": 16}
    assert PrefixMatch("ns", 0, ()).tier is None
