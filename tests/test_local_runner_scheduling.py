"""The engine's queue drives the tiers (tiny random Llama, a real store on disk): window jobs' KV is
fetched before they run, memory pressure sheds stored KV or refuses, and a restore can be awaited."""

from __future__ import annotations

import asyncio

import torch

from engine_api.turn import Failed, Finished
from kvtier import KVStore, StoreConfig
from local_runner.engine import EmbeddedEngine
from proxy.local.config import engine_config
from tests.support.waiting import async_wait_until
from tests.test_local_runner_batching import drain, greedy_alone, ids_of, submit
from tests.tiny_model import tiny_llama, tiny_loaded

MB = 1 << 20


def open_store(lm, path, l0=MB, l1=MB, chunk=16) -> KVStore:
    config = StoreConfig(l0, l1, 64 * MB, path, chunk_tokens=chunk, device=torch.device("cpu"))
    return KVStore(config, lm.layout, lm.fingerprint)


async def store_turn(lm, path, ids, n) -> None:
    """Turn 1 alone, saved to L2; the store is closed, so only the disk holds it afterwards."""
    store = open_store(lm, path)
    engine = EmbeddedEngine({"tiny": lm}, {"tiny": store}, config=engine_config()).start()
    try:
        done = await drain(submit(engine, "tiny", ids, n))
        assert isinstance(done.end, Finished)
    finally:
        engine.close()


def test_the_window_is_fetched_whenever_preload_is_on_whatever_the_eviction():
    """settings.json -> the engine: `preload.enabled` alone turns fetching on (its window of
    `lookahead_turns`); `scheduler_aware.enabled` is the eviction's and leaves fetching as it is."""
    import orjson

    from proxy.settings import parse_settings

    def settings(**store: dict):
        return parse_settings(orjson.dumps({"attention_store": store}), check_paths=False)

    def config(**store: dict):
        return engine_config(settings(**store))

    default = config()
    assert default.lookahead == settings().attention_store.preload.lookahead_turns > 0
    unaware = config(scheduler_aware={"enabled": False}, preload={"lookahead_turns": 3})
    assert unaware.lookahead == 3 and not unaware.scheduler_aware
    assert config(preload={"enabled": False}).lookahead == 0


async def test_a_window_jobs_kv_is_fetched_from_disk_while_another_job_runs(tmp_path):
    lm = tiny_loaded(model=tiny_llama(seed=11))
    first = ids_of(lm, "a first question about tiers and disks")
    await store_turn(lm, tmp_path, first, 12)
    answer = greedy_alone(lm, first, 12)
    second = first + answer + ids_of(lm, " more?")
    store = open_store(lm, tmp_path)  # a restart: the conversation is in L2 only
    engine = EmbeddedEngine(
        {"tiny": lm}, {"tiny": store}, config=engine_config(max_running=1, lookahead=1)
    ).start()
    try:
        long_job = submit(engine, "tiny", ids_of(lm, "keep talking"), 300)
        events = long_job.events()
        await anext(events)  # running: the next job waits in the queue, inside the window
        waiting = submit(engine, "tiny", second, 8)

        async def prefetch_issued() -> bool:
            return store.stats().prefetch_issued > 0

        await async_wait_until(prefetch_issued, "the window job's prefetch", timeout=30)
        assert await asyncio.to_thread(store.wait_prefetched, 30)
        long_job.cancel()
        [e async for e in events]
        turn2 = await drain(waiting)
        stats = store.stats()
    finally:
        engine.close()
    assert turn2.first is not None and turn2.first.reused_tokens > 0
    assert turn2.first.tiers["l2"] == 0  # nothing was read from disk on the critical path
    assert stats.prefetch_completed > 0 and stats.prefetch_used == stats.prefetch_completed
    assert turn2.text == lm.tokenizer.decode(greedy_alone(lm, second, 8), skip_special_tokens=True)


async def test_memory_pressure_sheds_stored_kv_or_refuses(tmp_path):
    lm = tiny_loaded(model=tiny_llama(seed=12))
    ids = ids_of(lm, "pressure test prompt")
    for evict in (True, False):
        store = open_store(lm, tmp_path / str(evict))
        calm = EmbeddedEngine({"tiny": lm}, {"tiny": store}, config=engine_config()).start()
        await drain(submit(calm, "tiny", ids, 8))  # stored in L0 and on disk
        calm.stop()  # its stores stay open for the next engine
        store.flush()
        before = store.stats()
        # An impossible amount of memory to keep free: the machine is "short" for every job.
        engine = EmbeddedEngine(
            {"tiny": lm},
            {"tiny": store},
            config=engine_config(evict_on_pressure=evict, min_free_memory_bytes=1 << 50),
        ).start()
        try:
            out = await drain(submit(engine, "tiny", ids_of(lm, "another prompt"), 4))
            after = store.stats()
            where = store.lookup("anonymous", ids, count=False).tier  # the first prompt's KV
        finally:
            engine.close()
        if evict:
            assert isinstance(out.end, Finished)
            assert after.evictions > before.evictions and where == "l2"  # dropped from memory, kept on disk
        else:
            assert isinstance(out.end, Failed) and out.end.status == 503 and out.end.code == "memory_pressure"
            assert after.evictions == before.evictions and where == "l0"


def test_a_jobs_kv_counts_against_host_memory_only_where_its_pool_is_on_the_host(monkeypatch):
    """On CUDA a job's pages are on the device, allocated at start: the host's free memory is no reason
    to refuse it (it was compared with the job's device bytes)."""
    from types import SimpleNamespace

    from local_runner import memory_guard
    from local_runner.kv_pages import PagePool
    from local_runner.memory_guard import MemoryGuard

    layout = tiny_loaded().layout
    monkeypatch.setattr(memory_guard, "available_memory_bytes", lambda: 3 << 30)
    config = engine_config(evict_on_pressure=False, min_free_memory_bytes=2 << 30)
    job = SimpleNamespace(request=SimpleNamespace(model="m"), kv_bytes=2 << 30)  # 1 GiB short on the host
    for device, refused in (("cpu", True), ("cuda", False)):
        pool = PagePool(layout, torch.device(device), 4, 256)  # nothing allocated: no device needed
        why = MemoryGuard(config, {"m": pool}, {}).refusal(job)  # type: ignore[arg-type]
        assert (why is not None) == refused, (device, why)


async def test_without_overlap_a_job_waits_for_its_restore_and_answers_the_same(tmp_path):
    lm = tiny_loaded(model=tiny_llama(seed=13))
    first = ids_of(lm, "overlap or not")
    await store_turn(lm, tmp_path, first, 10)
    second = first + greedy_alone(lm, first, 10) + ids_of(lm, " and?")
    for overlap in (True, False):
        store = open_store(lm, tmp_path)
        engine = EmbeddedEngine(
            {"tiny": lm}, {"tiny": store}, config=engine_config(overlap_with_compute=overlap)
        ).start()
        try:
            out = await drain(submit(engine, "tiny", second, 8))
        finally:
            engine.close()
        assert out.first is not None and out.first.tiers["l2"] > 0
        assert out.text == lm.tokenizer.decode(greedy_alone(lm, second, 8), skip_special_tokens=True)


async def test_a_turn_that_ends_on_its_first_step_still_saves_its_kv(tmp_path):
    """A job that reused stored KV and ends with its first token (max_tokens=1) while its restore was
    still settling saves its prompt's KV all the same: the next turn finds it."""
    lm = tiny_loaded(model=tiny_llama(seed=14))
    store = open_store(lm, tmp_path)
    engine = EmbeddedEngine({"tiny": lm}, {"tiny": store}, config=engine_config()).start()
    try:
        first = ids_of(lm, "one word answers only please")
        await drain(submit(engine, "tiny", first, 6))
        for n in range(5):
            second = first + ids_of(lm, f" and number {n}?")
            out = await drain(submit(engine, "tiny", second, 1))
            assert out.first is not None and out.first.reused_tokens > 0
            assert store.lookup("anonymous", second, count=False).tokens == len(second)
    finally:
        engine.close()
