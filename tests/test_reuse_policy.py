"""Load or recompute (local_runner/reuse_policy.py): only the part of a stored prefix that loads faster
than it recomputes is restored, by measured speeds; the turn says how many stored tokens it recomputed."""

from __future__ import annotations

from kvtier import PrefixMatch
from kvtier.config import ChunkRef
from kvtier.load_rates import LoadRates
from local_runner.reuse_policy import PrefillRate, restore_prefix


def _match(*tiers: str, n: int = 100) -> PrefixMatch:
    chunks = tuple(ChunkRef(f"k{i}", i * n, n, tier) for i, tier in enumerate(tiers))  # type: ignore[arg-type]
    return PrefixMatch("ns", n * len(chunks), chunks)


def test_everything_is_restored_until_the_prefill_speed_is_measured():
    match = _match("l0", "l2", "l2")
    assert restore_prefix(match, {"l2": 1.0}, 1000, None) is match


def test_slow_disk_chunks_at_the_end_are_recomputed_and_fast_ones_kept():
    # 1,000 bytes a token; prefill 1 ms a token; L2 loads 100 KB/s (10 ms a token): recompute the L2 tail
    match = _match("l0", "l1", "l2", "l2")
    kept = restore_prefix(match, {"l0": 1e12, "l1": 1e10, "l2": 1e5}, 1000, 1e-3)
    assert [c.tier for c in kept.chunks] == ["l0", "l1"] and kept.tokens == 200


def test_a_slow_chunk_between_fast_ones_is_loaded_when_that_still_pays():
    # L2 costs 2 ms a token against a 1 ms prefill, but the two L0 chunks after it save 2 x 100 ms
    match = _match("l0", "l2", "l0", "l0")
    kept = restore_prefix(match, {"l0": 1e12, "l2": 5e5}, 1000, 1e-3)
    assert kept is match
    # ... and not when it costs more than all that follows saves
    kept = restore_prefix(match, {"l0": 1e12, "l2": 2e4}, 1000, 1e-3)
    assert kept.tokens == 100


def test_rates_are_moving_averages_of_what_was_measured():
    rates = LoadRates()
    rates.observe("l2", 100, 1.0)  # too small to say anything
    assert rates.snapshot() == {}
    rates.observe("l2", 4 << 20, 1.0)
    rates.observe("l2", 8 << 20, 1.0)
    assert abs(rates.snapshot()["l2"] - (0.7 * (4 << 20) + 0.3 * (8 << 20))) < 1
    speed = PrefillRate()
    speed.observe(10, 1.0)  # a small step: its fixed costs, not its speed
    assert speed.per_token is None
    speed.observe(200, 0.2)
    assert speed.per_token == 1e-3


async def test_a_turn_whose_stored_kv_loads_slower_than_it_computes_recomputes_it(tmp_path):
    """The engine's measured prefill against the store's measured L0 bandwidth: made so that loading loses,
    the second turn recomputes its stored prefix (FirstToken says how many tokens), with the answer a
    restore gives."""
    import torch

    from kvtier import KVStore, StoreConfig
    from local_runner.engine import EmbeddedEngine
    from proxy.local.config import engine_config
    from tests.test_local_runner_batching import drain, greedy_alone, ids_of, submit
    from tests.tiny_model import tiny_loaded

    lm = tiny_loaded()
    store = KVStore(
        StoreConfig(
            l0_capacity_bytes=1 << 22,
            l1_capacity_bytes=0,
            l2_capacity_bytes=1 << 24,
            l2_path=tmp_path / "kv",
            chunk_tokens=16,
            device=torch.device("cpu"),
        ),
        lm.layout,
        lm.fingerprint,
    )
    prompt = ids_of(lm, "Tell me about the sea, the wind and the rain.")
    engine = EmbeddedEngine({"tiny": lm}, {"tiny": store}, config=engine_config(max_running=2)).start()
    try:
        first = await drain(submit(engine, "tiny", prompt, 8))
        store.flush()
        turn2 = prompt + greedy_alone(lm, prompt, 8) + ids_of(lm, " and?")
        reused = await drain(submit(engine, "tiny", turn2, 8))
        assert (
            reused.first is not None and reused.first.reused_tokens >= 48 and reused.first.skipped_tokens == 0
        )
        engine.steps["tiny"].prefill_rate.observe(1000, 1e-6)  # recompute: 1 ns a token
        store._core.load_rates.observe("l0", 1 << 20, 10.0)  # loading: 100 KB/s
        recomputed = await drain(submit(engine, "tiny", turn2, 8))
    finally:
        engine.close()
    assert first.end is not None
    assert recomputed.first is not None and recomputed.first.reused_tokens == 0
    assert recomputed.first.skipped_tokens >= reused.first.reused_tokens  # the second turn stored more
    assert recomputed.text == reused.text
