"""Scheduler-aware tiering in kvtier: eviction follows the queue, prefetch brings chunks up to L0, the
placement hint decides where new KV stays, and the prefetch counters say what the look-ahead was worth."""

from __future__ import annotations

import pytest
import torch

from kvtier import KVStore, Schedule
from kvtier.schedule import eviction_order
from tests.test_kvtier import CB, CHUNK, kv, make, toks


def keys_of(store: KVStore, base: int, n: int = CHUNK) -> list[str]:
    return [c.key for c in store.lookup("t", toks(n, base), count=False).chunks]


def tier_of(store: KVStore, base: int, n: int = CHUNK) -> str | None:
    return store.lookup("t", toks(n, base), count=False).tier


def test_eviction_order_spares_the_window_and_takes_the_back_of_the_queue_last():
    lru = ["a", "b", "c", "d", "e"]
    schedule = Schedule.from_queue(running=[["a"]], queue=[["b"], ["c"], ["d"]], window=1)
    assert schedule.protected == {"a", "b"}
    assert eviction_order(lru, schedule) == ["e", "d", "c"]  # unscheduled first, then queue's back first
    assert eviction_order(lru, None) == lru


def test_a_window_jobs_chunk_survives_pressure_that_plain_lru_would_evict(tmp_path):
    for aware in (False, True):
        store = make(tmp_path / str(aware), l0=0, l1=3 * CB, l2=0)
        for base in (0, 100, 200):  # three sessions fill L1; session 0 is the least recently used
            store.put("t", toks(CHUNK, base), kv(CHUNK, seed=base))
        if aware:  # session 0's next turn waits in the window; session 100's further back
            store.set_schedule(Schedule.from_queue([], [keys_of(store, 0), keys_of(store, 100)], window=1))
        store.put("t", toks(CHUNK, 300), kv(CHUNK, seed=3))  # needs one chunk of room
        kept = {base: tier_of(store, base) for base in (0, 100, 200, 300)}
        if aware:  # the unscheduled session goes; the window one and the queued one stay
            assert kept == {0: "l1", 100: "l1", 200: None, 300: "l1"}
        else:  # LRU: the oldest goes, although its job is next
            assert kept == {0: None, 100: "l1", 200: "l1", 300: "l1"}
        store.close()


def test_queued_chunks_go_from_the_back_of_the_queue(tmp_path):
    store = make(tmp_path, l0=0, l1=2 * CB, l2=0)
    store.put("t", toks(CHUNK, 0), kv(CHUNK))
    store.put("t", toks(CHUNK, 100), kv(CHUNK))
    # Both queued beyond the window: 0 runs second, 100 runs third. 100 is the more recently used.
    store.set_schedule(Schedule.from_queue([], [[], keys_of(store, 0), keys_of(store, 100)], window=1))
    store.put("t", toks(CHUNK, 200), kv(CHUNK))
    assert (tier_of(store, 0), tier_of(store, 100)) == ("l1", None)
    store.close()


def test_shedding_memory_keeps_what_the_schedule_protects(tmp_path):
    store = make(tmp_path, l0=4 * CB, l1=0, l2=8 * CB)
    store.put("t", toks(CHUNK, 0), kv(CHUNK))
    store.put("t", toks(CHUNK, 100), kv(CHUNK))
    store.set_schedule(Schedule.from_queue([keys_of(store, 0)], [], window=0))  # 0's job runs
    assert store.shed_device_memory() == CB  # only the unprotected chunk leaves L0
    assert (tier_of(store, 0), tier_of(store, 100)) == ("l0", "l2")
    store.put("t", toks(CHUNK, 200), kv(CHUNK))
    assert store.shed_memory(8 * CB) == CB  # the running job's chunk stays in memory
    assert (tier_of(store, 0), tier_of(store, 200)) == ("l0", "l2")
    store.close()


def test_demoting_l0_follows_the_schedule_so_the_sooner_job_keeps_l1(tmp_path):
    store = make(tmp_path, l0=4 * CB, l1=CB, l2=8 * CB)
    store.put("t", toks(CHUNK, 0), kv(CHUNK))  # a queued job's
    store.put("t", toks(CHUNK, 100), kv(CHUNK))  # no job's
    queued = keys_of(store, 0)
    keys_of(store, 100)  # now 0 is the least recently used: LRU alone would demote it first
    store.set_schedule(Schedule.from_queue([], [[], queued], window=1))
    assert store.shed_device_memory() == 2 * CB
    assert (tier_of(store, 0), tier_of(store, 100)) == ("l1", "l2")
    store.close()


def test_prefetch_brings_a_disk_chunk_up_to_l0_and_counts_it_used(tmp_path):
    store = make(tmp_path, l0=4 * CB, l1=4 * CB, l2=8 * CB)
    layers = kv(2 * CHUNK, seed=5)
    store.put("t", toks(2 * CHUNK), layers)
    store.close()
    store = make(tmp_path, l0=4 * CB, l1=4 * CB, l2=8 * CB)  # a restart: only L2 holds it
    match = store.lookup("t", toks(2 * CHUNK), count=False)
    assert match.tier == "l2"
    store.prefetch(match)
    assert store.wait_prefetched(10)
    assert store.lookup("t", toks(2 * CHUNK)).tokens_by_tier() == {"l0": 2 * CHUNK, "l1": 0, "l2": 0}
    st = store.stats()
    assert (st.prefetch_issued, st.prefetch_completed, st.prefetch_used, st.prefetch_wasted) == (2, 2, 2, 0)
    assert st.reused_tokens == {"l0": 2 * CHUNK, "l1": 0, "l2": 0}
    store.close()


def test_a_prefetch_whose_job_left_the_window_is_skipped(tmp_path):
    store = make(tmp_path, l0=4 * CB, l1=4 * CB, l2=8 * CB)
    store.put("t", toks(CHUNK, 0), kv(CHUNK))
    store.put("t", toks(CHUNK, 100), kv(CHUNK))
    store.close()
    store = make(tmp_path, l0=4 * CB, l1=4 * CB, l2=8 * CB)
    waiting, gone = (
        store.lookup("t", toks(CHUNK, 0), count=False),
        store.lookup("t", toks(CHUNK, 100), count=False),
    )
    # Both were in the window when their prefetch was queued; the second job left before it ran.
    store.set_schedule(Schedule.from_queue([], [[c.key for c in waiting.chunks]], window=1))
    store.prefetch(waiting)
    store.prefetch(gone)
    assert store.wait_prefetched(10)
    assert (tier_of(store, 0), tier_of(store, 100)) == ("l0", "l2")
    store.set_schedule(None)  # without a scheduler's view every prefetch runs
    store.prefetch(store.lookup("t", toks(CHUNK, 100), count=False))
    assert store.wait_prefetched(10)
    assert tier_of(store, 100) == "l0"
    store.close()


def test_a_prefetch_evicted_before_use_counts_as_wasted(tmp_path):
    store = make(tmp_path, l0=0, l1=CB, l2=4 * CB)
    store.put("t", toks(CHUNK, 0), kv(CHUNK))
    store.close()
    store = make(tmp_path, l0=0, l1=CB, l2=4 * CB)
    store.prefetch(store.lookup("t", toks(CHUNK, 0), count=False))
    assert store.wait_prefetched(10)
    assert tier_of(store, 0) == "l1"
    store.put("t", toks(CHUNK, 100), kv(CHUNK))  # takes L1's only place
    st = store.stats()
    assert (st.prefetch_completed, st.prefetch_used, st.prefetch_wasted) == (1, 0, 1)
    store.close()


def test_throughput_placement_keeps_l0_for_queued_jobs(tmp_path):
    for hint, expected in (("ttft_priority", "l0"), ("throughput", "l1")):
        store = make(tmp_path / hint, l0=4 * CB, l1=4 * CB, l2=4 * CB, placement_hint=hint)
        store.put("t", toks(CHUNK), kv(CHUNK))
        assert tier_of(store, 0) == expected
        store.prefetch(store.lookup("t", toks(CHUNK), count=False))
        assert store.wait_prefetched(10)
        assert tier_of(store, 0) == "l0"  # a queued job's chunks go to L0 in both modes
        store.close()


def _resident_pages(path) -> int | None:
    """Pages of the file in the OS page cache (util-linux fincore), None where it cannot say."""
    import shutil
    import subprocess

    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "-nb", "-o", "PAGES", str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


def test_drop_page_cache_leaves_written_files_out_of_the_page_cache(tmp_path):
    layers = kv(4 * CHUNK, seed=9)
    resident = {}
    for drop in (False, True):
        store = make(tmp_path / str(drop), l0=0, l1=0, l2=8 * CB, drop_page_cache=drop)
        store.put("t", toks(4 * CHUNK), layers)
        store.flush()
        paths = sorted((tmp_path / str(drop) / "l2").rglob("*.safetensors"))
        pages = [_resident_pages(p) for p in paths]
        if any(p is None for p in pages):
            pytest.skip("fincore (util-linux) is not available to read the page cache")
        resident[drop] = sum(p or 0 for p in pages)
        match = store.lookup("t", toks(4 * CHUNK))
        restored = store.load(match)
        assert torch.equal(restored.layer(0)[0], layers[0][0][:, :, : match.tokens])  # read back from disk
        store.close()
    assert resident[False] > 0 and resident[True] == 0


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the copy stream and its events exist there only"
)
def test_cuda_restore_copies_on_its_own_stream_with_one_event_per_layer(tmp_path):
    layers = kv(2 * CHUNK, seed=4)
    store = make(tmp_path, l0=0, l1=0, l2=8 * CB, device="cuda")
    store.put("t", toks(2 * CHUNK), layers)
    match = store.lookup("t", toks(2 * CHUNK))
    restored = store.load(match)
    for i, (k, _) in enumerate(layers):
        rk, _ = restored.layer(i)  # the reader's stream waits on layer i's event
        assert rk.device.type == "cuda" and torch.equal(rk.cpu(), k[:, :, : match.tokens])
    restored.wait()
    assert all(e is not None for e in restored._events)  # one copy-stream event per layer
    store.close()


@pytest.mark.parametrize(
    ("key", "value"), [("l0_eviction", "mru"), ("l1_eviction", "fifo"), ("l2_format", "npz")]
)
def test_a_policy_or_format_the_store_does_not_implement_is_refused(tmp_path, key, value):
    with pytest.raises(ValueError, match=key):
        make(tmp_path, **{key: value})
