"""The vLLM connector's parts without vLLM or a model: the arithmetic (plan.py), the options, and the
whole data path of a turn through the real store, its socket, the scheduler side and the worker side,
with paged caches laid out as CPU_ATTN lays them out on AVX-512 (the layouts themselves:
test_vllm_layouts.py).

Restored KV must land in the right slots of other blocks bit for bit, a corrupt L2 chunk must end as
blocks vLLM recomputes (never as KV served), and a forgotten session must be gone from the store."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvtier import KVLayout, KVStore, StoreConfig
from kvtier.chunk_folder import chunk_path
from tests.support.paged_kernels import cpu_keys_by_dim
from vllm_engine.link.discover import find_page_map
from vllm_engine.link.options import ConnectorOptions, model_fingerprint
from vllm_engine.link.pages import PagedLayer, PageGeometry
from vllm_engine.link.plan import (
    DEFAULT_NAMESPACE,
    StoredChunk,
    block_slots,
    blocks_of,
    check_chunk_size,
    covering_chunks,
    external_tokens,
    first_seen_tiers,
    layer_index,
    ordered_layers,
    parse_params,
    tokens_by_tier,
)
from vllm_engine.link.scheduler import SchedulerSide
from vllm_engine.link.service import StoreService
from vllm_engine.link.wire import StoreClient, StoreError, StoreSocketServer
from vllm_engine.link.worker import WorkerSide

LAYERS, HEADS, DIM, BLOCK, CHUNK, BLOCKS = 3, 2, 4, 4, 8, 32


# ---- the arithmetic ---------------------------------------------------------------------------------


def test_params_name_the_tenant_and_fall_back_to_vllms_own_isolation():
    p = parse_params({"attnstore": {"tenant": "t1", "session": "s", "turn": "u", "reuse": False}})
    assert (p.namespace, p.session, p.turn, p.reuse) == ("t1", "s", "u", False)
    assert parse_params(None).namespace == DEFAULT_NAMESPACE
    assert parse_params({"other": 1}, cache_salt="abc").namespace == "salt:abc"
    assert parse_params({"attnstore": {"tenant": 5}}).namespace == DEFAULT_NAMESPACE  # not a string


def test_the_store_never_supplies_the_last_prompt_token_nor_what_vllm_has():
    assert external_tokens(stored=100, prompt_tokens=100, local=0) == 99
    assert external_tokens(stored=100, prompt_tokens=300, local=64) == 36
    assert external_tokens(stored=64, prompt_tokens=300, local=128) == 0


def test_chunk_size_must_cover_whole_blocks():
    check_chunk_size(256, 128)
    check_chunk_size(256, 16)
    for chunk, block in ((200, 128), (64, 128), (0, 16)):
        with pytest.raises(ValueError, match="multiple"):
            check_chunk_size(chunk, block)


def test_tokens_by_tier_counts_only_the_loaded_range():
    chunks = [StoredChunk(0, 8, "l1"), StoredChunk(8, 8, "l2"), StoredChunk(16, 5, "l2")]
    assert tokens_by_tier(chunks, 4, 19) == {"l1": 4, "l2": 11}
    assert tokens_by_tier(chunks, 21, 30) == {}


def test_a_chunk_prefetched_meanwhile_still_reports_the_tier_it_was_found_in():
    first = [StoredChunk(0, 8, "l2"), StoredChunk(8, 8, "l2")]
    now = [StoredChunk(0, 8, "l1"), StoredChunk(8, 8, "l1"), StoredChunk(16, 3, "l1")]
    assert [c.tier for c in first_seen_tiers(first, now)] == ["l2", "l2", "l1"]


def test_a_load_reads_whole_chunks_from_the_one_holding_its_start():
    chunks = [StoredChunk(0, 8, "l1"), StoredChunk(8, 8, "l1"), StoredChunk(16, 8, "l1")]
    assert covering_chunks(chunks, 12, 20) == ([1, 2], 4)
    assert covering_chunks(chunks, 0, 8) == ([0], 0)
    assert covering_chunks(chunks, 24, 30) == ([], 0)


def test_block_slots_and_blocks_follow_vllms_block_table():
    blocks, offsets = block_slots(2, 7, [9, 3], 4)
    assert blocks == [9, 9, 3, 3, 3] and offsets == [2, 3, 0, 1, 2]
    assert blocks_of(3, 5, [9, 3, 7], 4) == {9, 3}
    assert blocks_of(5, 5, [9, 3], 4) == set()
    with pytest.raises(ValueError):
        block_slots(0, 9, [1, 2], 4)


def test_layers_in_order_once_each():
    names = [f"model.layers.{i}.self_attn.attn" for i in (2, 0, 1)]
    assert ordered_layers(names) == sorted(names, key=layer_index)
    assert layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(ValueError):
        ordered_layers(["model.layers.0.attn", "model.layers.2.attn"])


def test_options_refuse_unknown_keys_and_wrong_types():
    o = ConnectorOptions.from_extra({"l1_capacity_bytes": 5, "layerwise": False}, "engine-1")
    assert o.l1_capacity_bytes == 5 and o.layerwise is False and o.socket_path.endswith("engine-1.sock")
    with pytest.raises(ValueError, match="not an AttnStoreConnector option"):
        ConnectorOptions.from_extra({"l3": 1})
    with pytest.raises(ValueError, match="chunk_tokens"):
        ConnectorOptions.from_extra({"chunk_tokens": "256"})


def test_the_fingerprint_changes_with_the_weights_the_dtype_and_the_kernels(tmp_path: Path):
    (tmp_path / "model.safetensors").write_bytes(b"weights-a" * 1000)
    a = model_fingerprint(str(tmp_path), None, "float32", "vllm-0.32.0", "CPU_ATTN")
    assert a == model_fingerprint(str(tmp_path), None, "float32", "vllm-0.32.0", "CPU_ATTN")
    assert a != model_fingerprint(str(tmp_path), None, "bfloat16", "vllm-0.32.0", "CPU_ATTN")
    assert a != model_fingerprint(str(tmp_path), None, "float32", "vllm-0.32.0", "FLASH_ATTN")
    (tmp_path / "model.safetensors").write_bytes(b"weights-b" * 1000)
    assert a != model_fingerprint(str(tmp_path), None, "float32", "vllm-0.32.0", "CPU_ATTN")


def test_the_connector_module_imports_without_vllm():
    module = importlib.import_module("vllm_engine.connector")
    assert module.PINNED_VLLM == "0.32.0"
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="needs vLLM"):
            module.AttnStoreConnector(None, None)


# ---- a turn's data path: scheduler -> store socket -> worker -> pages ------------------------------------


@dataclass
class Engine:
    """What vLLM holds for the connector: its paged caches, the store's two sides, the socket."""

    store: KVStore
    service: StoreService
    scheduler: SchedulerSide
    worker: WorkerSide
    pages: list[PagedLayer]
    l2: Path


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    yield from _engine(tmp_path, l1_bytes=1 << 20)


def _engine(tmp_path: Path, l1_bytes: int, l2: Path | None = None) -> Iterator[Engine]:
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)
    l2 = l2 or tmp_path / "kv"
    config = StoreConfig(0, l1_bytes, 1 << 24, l2, chunk_tokens=CHUNK, async_save=False)
    store = KVStore(config, layout, "fp-test")
    service = StoreService(store)
    server = StoreSocketServer(tmp_path / "store.sock", service.handlers())
    client = StoreClient(tmp_path / "store.sock")
    caches = [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    # Laid out as CPU_ATTN on AVX-512 lays them out, the map found through that kernel as at start.
    page_map = find_page_map(cpu_keys_by_dim, caches[0], PageGeometry(HEADS, DIM, BLOCK), "CPU_ATTN (test)")
    pages = [PagedLayer(c, page_map) for c in caches]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker = WorkerSide(store, service, pages, names)
    scheduler = SchedulerSide(client, block_size=BLOCK, prefetch=False)
    try:
        yield Engine(store, service, scheduler, worker, pages, l2)
    finally:
        client.close()
        server.close()
        worker.close()


def _compute(e: Engine, blocks: list[int], n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Stand-in for vLLM's forward: KV of n tokens written into the request's blocks."""
    gen = torch.Generator().manual_seed(seed)
    kv = [
        (torch.randn(HEADS, n, DIM, generator=gen), torch.randn(HEADS, n, DIM, generator=gen))
        for _ in range(LAYERS)
    ]
    for page, (k, v) in zip(e.pages, kv, strict=True):
        page.scatter(page.slots(*block_slots(0, n, blocks, BLOCK)), k, v)
    return kv


def _step(e: Engine, new: list[tuple[str, int]], *, layerwise_saves: bool = True) -> None:
    """One engine step as vLLM's model runner drives the worker side."""
    e.worker.begin(e.scheduler.plan_step(new, []))
    e.worker.start_loads()
    for i in range(LAYERS):
        e.worker.layer_loaded(i)
        if layerwise_saves:
            e.worker.save_layer(i)
    e.worker.end_step()


def _first_turn(
    e: Engine, prompt: list[int], answer: int, blocks: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    params = parse_params({"attnstore": {"tenant": "t", "session": "s1", "turn": "turn-1"}})
    e.scheduler.arrived("r1", prompt, params)
    assert e.scheduler.matched_tokens("r1", 0) == 0  # nothing stored yet
    _step(e, [("r1", 0)])
    computed = len(prompt) + answer - 1  # the last answer token has no KV yet
    kv = _compute(e, blocks, computed, seed=1)
    tokens = [*prompt, *range(1000, 1000 + answer)][:computed]
    assert e.scheduler.finished("r1", tokens, blocks, [None] * len(blocks)) is True  # hold the blocks
    _step(e, [], layerwise_saves=False)  # an empty step: no forward, the copy happens at its end
    assert e.worker.finished_saving() == {"r1"}
    return kv


def test_a_finished_turn_is_saved_and_the_next_one_restored_into_other_blocks(engine: Engine):
    e = engine
    prompt = list(range(21))
    kv = _first_turn(e, prompt, answer=5, blocks=[3, 4, 5, 6, 7, 8, 9])
    saved = e.service.turn("turn-1", wait_s=10, saved=True)
    assert saved is not None and len(saved["keys"]) == 4  # 25 tokens in chunks of 8
    next_prompt = [*prompt, *range(1000, 1004), 77, 78, 79]  # the history, then a new message
    e.scheduler.arrived("r2", next_prompt, parse_params({"attnstore": {"tenant": "t", "turn": "turn-2"}}))
    assert e.scheduler.matched_tokens("r2", 0) == 25
    blocks = [20, 11, 17, 13, 14, 15, 16, 12]
    e.scheduler.allocated("r2", blocks, 25)
    _step(e, [("r2", 25)])
    for page, (k, v) in zip(e.pages, kv, strict=True):
        got_k, got_v = page.gather(page.slots(*block_slots(0, 25, blocks, BLOCK)))
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert e.worker.invalid_blocks() == set()
    report = e.service.turn("turn-2")
    assert report is not None and report["tiers"] == {"l0": 0, "l1": 25, "l2": 0}


def test_only_what_vllms_cache_lacks_is_restored(engine: Engine):
    e = engine
    kv = _first_turn(e, list(range(21)), answer=5, blocks=[3, 4, 5, 6, 7, 8, 9])
    e.scheduler.arrived(
        "r2", [*range(21), *range(1000, 1004), 5], parse_params({"attnstore": {"tenant": "t", "turn": "u2"}})
    )
    assert e.scheduler.matched_tokens("r2", 8) == 17  # vLLM holds the first two blocks itself
    blocks = [20, 21, 22, 23, 24, 25, 26]
    e.scheduler.allocated("r2", blocks, 17)
    _step(e, [("r2", 25)])
    page = e.pages[1]
    assert page.gather(page.slots(*block_slots(0, 8, blocks, BLOCK)))[0].abs().sum() == 0  # untouched
    got_k, _ = page.gather(page.slots(*block_slots(8, 25, blocks, BLOCK)))
    assert torch.equal(got_k, kv[1][0][:, 8:25])
    report = e.service.turn("u2")
    assert report is not None and report["tiers"] == {"l0": 8, "l1": 17, "l2": 0}


def test_another_tenant_matches_nothing(engine: Engine):
    _first_turn(engine, list(range(21)), answer=5, blocks=[3, 4, 5, 6, 7, 8, 9])
    engine.scheduler.arrived("r2", list(range(30)), parse_params({"attnstore": {"tenant": "other"}}))
    assert engine.scheduler.matched_tokens("r2", 0) == 0


def test_a_forgotten_session_matches_nothing(engine: Engine):
    _first_turn(engine, list(range(21)), answer=5, blocks=[3, 4, 5, 6, 7, 8, 9])
    assert engine.service.forget("t", "s1") == 4
    engine.scheduler.arrived("r2", list(range(26)), parse_params({"attnstore": {"tenant": "t"}}))
    assert engine.scheduler.matched_tokens("r2", 0) == 0


def test_the_proxy_retains_a_session_through_the_store_socket(engine: Engine):
    """The path forget takes: the proxy's `retain` reaches the store's table (kvtier/retention.py)."""
    _first_turn(engine, list(range(21)), answer=5, blocks=[3, 4, 5, 6, 7, 8, 9])
    assert engine.service.turn("turn-1", wait_s=10, saved=True) is not None  # the turn's put is done
    assert engine.service.handlers()["retain"](namespace="t", session="s1", seconds=30) > 0
    stats = engine.service.stats()
    assert stats["retained_sessions"] == 1 and stats["retained_bytes"]["l1"] > 0


def test_a_corrupt_l2_chunk_becomes_blocks_vllm_recomputes(tmp_path: Path):
    engines = _engine(tmp_path, l1_bytes=0)  # disk only: every restore reads its files
    e = next(engines)
    try:
        _first_turn(e, list(range(21)), answer=5, blocks=[3, 4, 5, 6, 7, 8, 9])
        saved = e.service.turn("turn-1", wait_s=10, saved=True)
        assert saved is not None
        path = chunk_path(e.l2, saved["keys"][1])
        data = bytearray(path.read_bytes())
        data[-10] ^= 0x01  # a flipped bit only a layer checksum can tell
        path.write_bytes(bytes(data))
        e.scheduler.arrived(
            "r2",
            [*range(21), *range(1000, 1004), 9],
            parse_params({"attnstore": {"tenant": "t", "turn": "u2"}}),
        )
        n = e.scheduler.matched_tokens("r2", 0)
        assert n == 25
        blocks = [20, 21, 22, 23, 24, 25, 26]
        e.scheduler.allocated("r2", blocks, n)
        _step(e, [("r2", n)])
        assert e.worker.invalid_blocks() == blocks_of(0, 25, blocks, BLOCK)  # vLLM recomputes them all
        report = e.service.turn("u2")
        assert report is not None and report["tiers"]["l1"] == report["tiers"]["l2"] == 0
        e.scheduler.arrived("r3", list(range(26)), parse_params({"attnstore": {"tenant": "t"}}))
        assert e.scheduler.matched_tokens("r3", 0) == 8  # the valid chunk before the bad one
    finally:
        engines.close()


def test_another_replica_finds_a_partial_chunk_through_the_session_hints(engine: Engine, tmp_path: Path):
    other_dir = tmp_path / "replica-b"
    other_dir.mkdir()
    engines = _engine(other_dir, l1_bytes=1 << 20, l2=engine.l2)  # the same L2 folder, started first
    b = next(engines)
    try:
        _first_turn(
            engine, list(range(21)), answer=5, blocks=[3, 4, 5, 6, 7, 8, 9]
        )  # 25 tokens: 3 chunks + 1
        saved = engine.service.turn("turn-1", wait_s=10, saved=True)
        assert saved is not None
        prompt = [*range(21), *range(1000, 1004), 50, 51]
        b.scheduler.arrived("r2", prompt, parse_params({"attnstore": {"tenant": "t"}}))
        assert b.scheduler.matched_tokens("r2", 0) == 24  # whole chunks only: the partial one has another key
        hinted = {"attnstore": {"tenant": "t", "hints": saved["keys"]}}
        b.scheduler.arrived("r3", prompt, parse_params(hinted))
        assert b.scheduler.matched_tokens("r3", 0) == 25
    finally:
        engines.close()


def test_the_socket_reports_errors_without_dying(engine: Engine, tmp_path: Path):
    client = StoreClient(tmp_path / "store.sock")
    try:
        with pytest.raises(StoreError, match="KeyError"):
            client.call("no-such-op")
        assert client.call("turn", turn="unknown") is None
    finally:
        client.close()
