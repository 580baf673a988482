"""kvtier: tiers, prefix matching, pinning, saving, restart, corruption, concurrency."""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvtier import KVLayout, KVLoadError, KVStore, StoreConfig
from kvtier.chunk import ChunkId, ChunkKV
from kvtier.chunk_folder import QUARANTINE, chunk_path
from kvtier.chunk_format import ChunkMeta
from kvtier.file_tier import FileTier
from kvtier.tier_interface import TierBackend
from kvtier.tier_registry import TierFactory

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
CHUNK = 4
CB = CHUNK * LAYOUT.bytes_per_token  # bytes of one full chunk
FP = "model-a"


def kv(n: int, layout: KVLayout = LAYOUT, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, layout.num_kv_heads, n, layout.head_dim)
    return [
        (torch.randn(shape, generator=g).to(layout.dtype), torch.randn(shape, generator=g).to(layout.dtype))
        for _ in range(layout.num_layers)
    ]


def make(
    tmp_path: Path, l0=100 * CB, l1=100 * CB, l2=100 * CB, layout=LAYOUT, fp=FP, tiers=None, **kw
) -> KVStore:
    kw.setdefault("async_save", False)
    cfg = StoreConfig(l0, l1, l2, tmp_path / "l2", chunk_tokens=CHUNK, **kw)
    return KVStore(cfg, layout, fp, tiers=tiers)


def own(tier_class: type[TierBackend], **attrs: object) -> TierFactory:
    """A tier backend of the test's own class (built from the config as the registered one is), with
    the given attributes set: the store's seam for another backend (tier_registry.py)."""

    def build(config: StoreConfig, layout: KVLayout, model_fingerprint: str) -> TierBackend:
        tier = tier_class.from_config(config, layout, model_fingerprint)
        for name, value in attrs.items():
            setattr(tier, name, value)
        return tier

    return build


class FullDiskTier(FileTier):
    """L2 on a disk that is full while `full` is set: every write fails with ENOSPC, as the OS says."""

    full: threading.Event

    def write(self, items: Sequence[tuple[ChunkId, ChunkKV]]) -> list[ChunkMeta | OSError]:
        if self.full.is_set():
            return [OSError(errno.ENOSPC, "No space left on device") for _ in items]
        return super().write(items)


class GatedFileTier(FileTier):
    """L2 whose writes wait for `gate` once they have said so (`writing`): a test holds a save thread
    inside its write."""

    gate: threading.Event
    writing: threading.Event

    def write(self, items: Sequence[tuple[ChunkId, ChunkKV]]) -> list[ChunkMeta | OSError]:
        self.writing.set()
        self.gate.wait()
        return super().write(items)


class HeldAfterWriteTier(FileTier):
    """L2 whose writes, once their files are on disk, wait for `gate` after saying so (`written`): a
    test holds a save between its file and its bookkeeping."""

    gate: threading.Event
    written: threading.Event

    def write(self, items: Sequence[tuple[ChunkId, ChunkKV]]) -> list[ChunkMeta | OSError]:
        done = super().write(items)
        self.written.set()
        self.gate.wait()
        return done


def toks(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def assert_restored(store: KVStore, match, layers, n: int) -> None:
    r = store.load(match)
    for i, (k, v) in enumerate(layers):
        rk, rv = r.layer(i)
        assert rk.shape == rv.shape == (1, LAYOUT.num_kv_heads, n, LAYOUT.head_dim)
        assert torch.equal(rk, k[:, :, :n]) and torch.equal(rv, v[:, :, :n])
    r.wait()


def files(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "l2").rglob("*.safetensors") if QUARANTINE not in p.parts]


def quarantined(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "l2" / QUARANTINE).glob("*")) if (tmp_path / "l2" / QUARANTINE).exists() else []


# ---- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tier", ["l0", "l1", "l2", "restart"])
def test_bit_exact_round_trip(tmp_path, dtype, tier):
    layout = KVLayout(3, 2, 8, dtype)
    cb = CHUNK * layout.bytes_per_token
    caps = {"l0": (10 * cb, 10 * cb), "l1": (0, 10 * cb)}.get(tier, (0, 0))
    layers = kv(10, layout, seed=3)
    s = make(tmp_path, *caps, l2=10 * cb, layout=layout)
    s.put("t", toks(10), layers)
    if tier == "restart":
        s.close()
        s = make(tmp_path, 0, 0, 10 * cb, layout=layout)
    m = s.lookup("t", toks(10))
    assert m.tokens == 10 and m.tier == ("l2" if tier == "restart" else tier)
    r = s.load(m)
    for i, (k, v) in enumerate(layers):
        rk, rv = r.layer(i)
        assert rk.dtype == dtype and rk.shape == (1, 2, 10, 8)
        assert torch.equal(rk.view(torch.uint8), k.view(torch.uint8))
        assert torch.equal(rv.view(torch.uint8), v.view(torch.uint8))
    r.wait()
    s.close()


def test_put_copies_input(tmp_path):
    s = make(tmp_path)
    layers = kv(8)
    orig = [(k.clone(), v.clone()) for k, v in layers]
    s.put("t", toks(8), layers)
    for k, v in layers:
        k.zero_()
        v.zero_()
    assert_restored(s, s.lookup("t", toks(8)), orig, 8)


def test_accepts_3d_and_longer_tensors(tmp_path):
    s = make(tmp_path)
    layers = kv(12)
    s.put("t", toks(9), [(k[0], v[0]) for k, v in layers])
    m = s.lookup("t", toks(12))
    assert m.tokens == 9
    assert_restored(s, m, layers, 9)


def test_wrong_shape_or_dtype_is_rejected(tmp_path):
    s = make(tmp_path)
    with pytest.raises(ValueError):
        s.put("t", toks(4), kv(4)[:2])
    with pytest.raises(ValueError):
        s.put("t", toks(8), kv(4))
    with pytest.raises(ValueError):
        s.put("t", toks(4), [(k.half(), v.half()) for k, v in kv(4)])


# ---- prefix matching -------------------------------------------------------------------------------


def test_partial_reuse_up_to_first_difference(tmp_path):
    s = make(tmp_path)
    layers = kv(10)
    s.put("t", toks(10), layers)
    q = toks(10)
    q[6] = 999  # differs inside chunk 1
    m = s.lookup("t", q + [5, 6])
    assert m.tokens == 6 and [c.n_tokens for c in m.chunks] == [4, 2]
    assert_restored(s, m, layers, 6)
    # the last partial chunk of a short conversation stays usable
    m = s.lookup("t", toks(9) + [777])
    assert m.tokens == 9 and [c.n_tokens for c in m.chunks] == [4, 4, 1]
    assert s.lookup("t", [999] + toks(9)).tokens == 0


def test_namespaces_never_share(tmp_path):
    s = make(tmp_path)
    s.put("a", toks(8), kv(8))
    assert s.lookup("b", toks(8)).tokens == 0
    assert s.chain_keys("a", toks(8)) != s.chain_keys("b", toks(8))
    assert s.lookup("a", toks(8)).tokens == 8


def test_put_stores_only_new_chunks_and_drops_superseded_partial(tmp_path):
    s = make(tmp_path)
    keys6 = s.put("t", toks(6), kv(6))  # 4 + partial 2
    assert keys6 == s.chain_keys("t", toks(6))
    assert len(files(tmp_path)) == 2
    saved = s.stats().bytes_saved
    layers = kv(12, seed=1)
    s.put("t", toks(12), layers)  # chunk 0 exists; chunk 1 supersedes the partial one
    st = s.stats()
    assert st.bytes_saved - saved == 8 * LAYOUT.bytes_per_token
    assert len(files(tmp_path)) == 3 and st.tiers["l2"].entries == 3
    assert not chunk_path(tmp_path / "l2", keys6[1]).exists()
    # a shorter put covered by a longer stored sibling stores nothing and returns the covering key
    k = s.put("t", toks(6), kv(6))
    assert k[1] == s.chain_keys("t", toks(12))[1]
    assert s.stats().bytes_saved == st.bytes_saved


# ---- tiers, eviction, pinning ------------------------------------------------------------------------


def test_demotion_order_l0_l1_l2(tmp_path):
    s = make(tmp_path, l0=2 * CB, l1=2 * CB, l2=100 * CB)
    for c in range(5):
        s.put("t", toks(4, base=100 * c), kv(4, seed=c))
    tiers = [s.lookup("t", toks(4, base=100 * c)).tier for c in range(5)]
    assert tiers == ["l2", "l1", "l1", "l0", "l0"]
    st = s.stats()
    assert st.evictions_by_tier["l0"] == 3 and st.evictions_by_tier["l1"] == 1
    # a hit from L2 is promoted into L0 after loading
    m = s.lookup("t", toks(4))
    s.load(m).wait()
    assert s.lookup("t", toks(4)).tier == "l0"


def test_l2_drops_least_recently_used_file(tmp_path):
    s = make(tmp_path, 0, 0, 2 * CB)
    s.put("t", toks(4, 0), kv(4))
    s.put("t", toks(4, 100), kv(4))
    assert s.lookup("t", toks(4, 0)).tokens == 4  # touch A: B is now the LRU
    s.put("t", toks(4, 200), kv(4))
    assert s.lookup("t", toks(4, 100)).tokens == 0
    assert s.lookup("t", toks(4, 0)).tokens == 4 and s.lookup("t", toks(4, 200)).tokens == 4
    assert len(files(tmp_path)) == 2


def test_an_l2_eviction_leaves_its_file_at_once_and_is_unlinked_off_the_put(tmp_path, monkeypatch):
    """Unlinking a chunk's file takes milliseconds (its blocks and cached pages are freed): a put that
    evicts L2 files renames them away at once, and a thread of the tier unlinks them."""
    import kvtier.file_tier as file_tier

    gate, started = threading.Event(), threading.Event()
    real = file_tier._unlink_all

    def held(paths):
        started.set()
        gate.wait(10)
        real(paths)

    monkeypatch.setattr(file_tier, "_unlink_all", held)
    s = make(tmp_path, 0, 0, 2 * CB)
    evicted = chunk_path(tmp_path / "l2", s.chain_keys("t", toks(4, 0))[0])
    s.put("t", toks(4, 0), kv(4))
    s.put("t", toks(4, 100), kv(4))
    assert evicted.exists()
    s.put("t", toks(4, 200), kv(4))  # evicts the first: it returns while that file's unlink is held
    assert started.wait(10)
    assert not evicted.exists() and len(files(tmp_path)) == 2
    assert len(list((tmp_path / "l2").rglob("*.tmp"))) == 1  # renamed, not unlinked yet
    assert s.lookup("t", toks(4, 0)).tokens == 0 and s.lookup("t", toks(4, 200)).tokens == 4
    gate.set()
    s.close()
    assert not list((tmp_path / "l2").rglob("*.tmp"))


@pytest.mark.parametrize(("tier", "policy"), [("l0", "lru"), ("l0", "lfu"), ("l2", "lru")])
def test_pressure_gives_a_chain_up_from_its_end_so_its_prefix_still_matches(tmp_path, tier, policy):
    """A conversation of 4 chunks, stored over two turns and looked up, then another of 4: 2 chunks must
    go, and they go from the end of a chain, so what is left of it still matches (had its head gone, the
    rest would be unreachable). LRU gives up the first conversation's last two; LFU the second's, which
    no lookup has used yet (its own head is placed last, so its end gives way to it)."""
    l0, l2 = (6 * CB, 0) if tier == "l0" else (0, 6 * CB)
    s = make(tmp_path, l0=l0, l1=0, l2=l2, l0_eviction=policy)
    s.put("t", toks(8), kv(8, seed=1))
    s.put("t", toks(16), kv(16, seed=1))  # the next turn: two chunks more below the first two
    assert s.lookup("t", toks(16)).tokens == 16
    s.put("t", toks(16, 100), kv(16, seed=2))
    kept = (8, 16) if policy == "lru" else (16, 8)
    assert (
        s.lookup("t", toks(16), count=False).tokens,
        s.lookup("t", toks(16, 100), count=False).tokens,
    ) == kept
    assert s.stats().evictions_by_tier[tier] == 2
    s.close()


def test_pinned_entries_survive_pressure(tmp_path):
    s = make(tmp_path, l0=CB, l1=0, l2=CB)
    a = kv(4, seed=1)
    s.put("t", toks(4, 0), a)
    m = s.lookup("t", toks(4, 0))
    with s.acquire(m):
        s.put("t", toks(4, 100), kv(4))  # neither L0 nor L2 can make room: not stored
        assert s.lookup("t", toks(4, 100)).tokens == 0
        assert s.lookup("t", toks(4, 0)).tier == "l0"
        st = s.stats()
        assert st.tiers["l0"].used_bytes <= CB and st.tiers["l2"].used_bytes <= CB
    assert_restored(s, m, a, 4)
    s.put("t", toks(4, 200), kv(4))  # released: now A can go
    assert s.lookup("t", toks(4, 200)).tier == "l0"
    assert s.lookup("t", toks(4, 0)).tokens == 0


def test_chunk_larger_than_tier_skips_it(tmp_path):
    s = make(tmp_path, l0=CB // 2, l1=CB, l2=CB)
    s.put("t", toks(4), kv(4))
    assert s.lookup("t", toks(4)).tier == "l1"
    assert s.stats().tiers["l0"].used_bytes == 0


# ---- persistence, sharing, corruption ---------------------------------------------------------------


def test_restart_keeps_entries_and_sessions(tmp_path):
    s = make(tmp_path, async_save=True)
    layers = kv(10)
    s.put("t", toks(10), layers, session="s1")
    s.put("t", toks(4, 500), kv(4), session="s2")
    s.close()
    s2 = make(tmp_path)
    st = s2.stats()
    assert st.tiers["l2"].entries == 4 and st.tiers["l2"].used_bytes == 14 * LAYOUT.bytes_per_token
    m = s2.lookup("t", toks(10))
    assert m.tokens == 10 and m.tier == "l2"
    assert_restored(s2, m, layers, 10)
    assert s2.forget_session("t", "s1") == 3
    assert s2.lookup("t", toks(10)).tokens == 0 and len(files(tmp_path)) == 1
    assert s2.forget_namespace("t") == 1 and files(tmp_path) == []


def _one_file(tmp_path: Path) -> Path:
    s = make(tmp_path)
    s.put("t", toks(4), kv(4))
    s.close()
    (f,) = files(tmp_path)
    return f


def _rewrite_metadata(path: Path, **changes: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        md = dict(f.metadata())
        names = list(f.keys())
        tensors = {k: f.get_tensor(k) for k in names}
    md.update(changes)
    save_file(tensors, str(path), metadata=md)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "version", "wrong_key", "bad_tokens"])
def test_bad_file_at_start_is_a_quarantined_miss(tmp_path, damage):
    f = _one_file(tmp_path)
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        f.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        f.write_bytes(b"")
    elif damage == "version":
        _rewrite_metadata(f, format_version="999")
    elif damage == "wrong_key":  # a file claiming a key its content does not hash to
        f.rename(f.parent / ("0" * 32 + ".safetensors"))
    elif damage == "bad_tokens":
        _rewrite_metadata(f, token_ids="[9, 9, 9, 9]")
    s = make(tmp_path)
    assert s.lookup("t", toks(4)).tokens == 0
    assert files(tmp_path) == [] and len(quarantined(tmp_path)) == 1
    assert s.stats().quarantined == 1


def test_bit_flip_in_tensor_data_is_a_load_error_then_a_miss(tmp_path):
    f = _one_file(tmp_path)
    data = bytearray(f.read_bytes())
    data[-10] ^= 0x01  # header stays valid; the last layer's V changes
    f.write_bytes(bytes(data))
    s = make(tmp_path, 0, 0, 100 * CB)
    m = s.lookup("t", toks(4))
    assert m.tokens == 4 and m.tier == "l2"
    r = s.load(m)
    r.layer(0)  # earlier layers are intact and served
    with pytest.raises(KVLoadError):
        r.wait()
    with pytest.raises(KVLoadError):
        r.layer(LAYOUT.num_layers - 1)
    assert s.lookup("t", toks(4)).tokens == 0
    assert len(quarantined(tmp_path)) == 1
    st = s.stats()
    assert st.load_errors == 1 and st.misses == 2  # the failed load, then the lookup that missed


def test_foreign_model_files_are_left_alone(tmp_path):
    other = make(tmp_path, fp="model-b")
    other.put("t", toks(4), kv(4))
    other.close()
    s = make(tmp_path)
    assert s.lookup("t", toks(4)).tokens == 0
    assert len(files(tmp_path)) == 1 and quarantined(tmp_path) == []
    assert s.stats().tiers["l2"].entries == 0


def test_crash_mid_write_leaves_nothing_readable(tmp_path, monkeypatch):
    s = make(tmp_path)
    real_writev = os.writev

    def partial_write(fd, buffers):
        real_writev(fd, [b"partial"])
        raise KeyboardInterrupt  # dies mid-write, after the temp file was created

    monkeypatch.setattr(os, "writev", partial_write)
    with pytest.raises(KeyboardInterrupt):
        s.put("t", toks(12), kv(12))  # three chunks in one batch: none may be left behind
    monkeypatch.undo()
    assert files(tmp_path) == []
    # a leftover temp file from a hard crash is never indexed
    d = tmp_path / "l2" / "ab"
    d.mkdir(parents=True, exist_ok=True)
    (d / ".abcd.tmp").write_bytes(b"partial")
    s2 = make(tmp_path)
    assert s2.stats().tiers["l2"].entries == 0 and s2.lookup("t", toks(4)).tokens == 0


def test_disk_full_pauses_saving_but_serving_goes_on(tmp_path, caplog):
    full = threading.Event()
    full.set()
    # paused for this whole test
    s = make(tmp_path, async_save=True, disk_full_backoff_s=60.0, tiers={"l2": own(FullDiskTier, full=full)})
    layers = kv(8)
    s.put("t", toks(8), layers)
    s.flush()
    st = s.stats()
    assert not st.saving_enabled and st.save_errors >= 1 and st.saves_pending == 0
    assert st.tiers["l2"].used_bytes == 0
    assert "disk full" in caplog.text
    m = s.lookup("t", toks(8))
    assert m.tokens == 8 and m.tier == "l0"
    assert_restored(s, m, layers, 8)
    s.put("t", toks(4, 100), kv(4))
    s.flush()
    assert s.stats().save_errors == st.save_errors  # no attempts while paused
    s.close()


def test_second_replica_adopts_shared_files(tmp_path):
    a = make(tmp_path)
    b = make(tmp_path)  # scanned before a wrote anything
    layers = kv(10)
    keys = a.put("t", toks(10), layers)
    m = b.lookup("t", toks(10))
    assert m.tokens == 8 and m.tier == "l2"  # full chunks found by a stat of the chained key
    m = b.lookup("t", toks(10), hint_keys=keys)
    assert m.tokens == 10 and m.tier == "l2"  # the partial chunk needs the hint
    assert_restored(b, m, layers, 10)


def test_stats_shape_is_json(tmp_path):
    s = make(tmp_path)
    s.put("t", toks(4), kv(4))
    s.lookup("t", toks(4))
    s.lookup("t", toks(4, 100))
    d = json.loads(json.dumps(s.stats().to_dict()))
    assert set(d["tiers"]) == {"l0", "l1", "l2"}
    assert set(d["tiers"]["l0"]) == {"used_bytes", "capacity_bytes", "entries"}
    assert d["hits"]["l0"] == 1 and d["misses"] == 1 and d["bytes_saved"] == CB
    for key in ("evictions", "bytes_loaded", "saves_pending", "save_errors", "saving_enabled"):
        assert key in d


# ---- saving in the background, concurrency ---------------------------------------------------------


def test_a_full_save_queue_skips_saves_and_never_blocks_put(tmp_path):
    """A disk behind (the only save worker held in its write, a queue of one): put() returns at once,
    the chunks the queue could not take are counted and left out of L2, served from memory still."""
    gate, writing = threading.Event(), threading.Event()  # holds the only save worker inside its write
    gated = own(GatedFileTier, gate=gate, writing=writing)
    s = make(tmp_path, async_save=True, save_queue_chunks=1, save_workers=1, tiers={"l2": gated})
    try:
        s.put("t", toks(CHUNK), kv(CHUNK))  # one chunk: the worker takes it and waits at the gate
        assert writing.wait(10)
        s.put("t", toks(CHUNK, 500), kv(CHUNK))  # one chunk: queued
        done = threading.Event()
        t = threading.Thread(target=lambda: (s.put("t", toks(4 * CHUNK, 1000), kv(4 * CHUNK)), done.set()))
        t.start()  # 4 more chunks: the queue is full, none can wait for a place
        assert done.wait(10)  # put() did not wait for the gated disk
        stats = s.stats()
        assert (stats.saves_skipped, stats.saves_pending) == (4, 2)
        assert s.lookup("t", toks(4 * CHUNK, 1000)).tokens == 4 * CHUNK  # still served from memory
    finally:
        gate.set()
    s.flush()
    assert s.stats().saves_pending == 0 and len(files(tmp_path)) == 2
    s.close()


def test_a_session_forgotten_while_its_save_is_written_stays_forgotten(tmp_path):
    """DELETE right after a turn: its file lands on disk after the forget; a lookup in between must not
    adopt it as another replica's, and the save deletes it."""
    gate, written = threading.Event(), threading.Event()
    held = own(HeldAfterWriteTier, gate=gate, written=written)
    s = make(tmp_path, async_save=True, save_workers=1, tiers={"l2": held})
    try:
        s.put("t", toks(8), kv(8), session="s1")
        assert written.wait(10) and len(files(tmp_path)) == 1  # the first chunk of two
        assert s.forget_session("t", "s1") == 2
        assert s.lookup("t", toks(8)).tokens == 0
    finally:
        gate.set()
    s.flush()
    assert s.lookup("t", toks(8)).tokens == 0 and files(tmp_path) == []
    s.close()


def test_concurrent_put_and_get(tmp_path):
    """Four threads put, look up and load at once through memory tiers far smaller than what they put:
    every load is exact and no tier overflows. The save queue holds every chunk the test makes, so each
    chunk evicted from memory is in L2 (a chunk whose save a full queue skipped lives in memory only
    and may be evicted between lookup and acquire; the skip test covers that)."""
    s = make(
        tmp_path, l0=6 * CB, l1=6 * CB, l2=40 * CB, async_save=True, save_workers=2, save_queue_chunks=64
    )
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for it in range(12):
                base = 10_000 * w + 100 * (it % 4)
                layers = kv(10, seed=w * 100 + it % 4)
                s.put(f"ns{w % 2}", toks(10, base), layers, session=f"s{w}")
                m = s.lookup(f"ns{w % 2}", toks(10, base))
                with s.acquire(m):
                    r = s.load(m)
                    for i, (k, v) in enumerate(layers):
                        rk, rv = r.layer(i)
                        assert torch.equal(rk, k[:, :, : m.tokens]) and torch.equal(rv, v[:, :, : m.tokens])
                st = s.stats()
                for t in st.tiers.values():
                    assert t.used_bytes <= t.capacity_bytes
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s.flush()
    assert s.stats().saves_skipped == 0
    assert s.forget_session("ns0", "s0") > 0
    s.close()


# ---- L2 file format and read paths -----------------------------------------------------------------


def test_l2_file_is_plain_safetensors_both_ways(tmp_path):
    """Our hand-built files read with safetensors' load_file; files written by save_file (its own tensor
    order, k.* before v.*) read back through the store, bit-exact."""
    from safetensors.torch import load_file

    layers = kv(4)
    f = _one_file(tmp_path)
    loaded = load_file(str(f))
    assert set(loaded) == {f"{kv}.{i}" for i in range(LAYOUT.num_layers) for kv in "kv"}
    for i, (k, v) in enumerate(layers):
        assert torch.equal(loaded[f"k.{i}"], k[0]) and torch.equal(loaded[f"v.{i}"], v[0])
    _rewrite_metadata(f)  # same tensors and metadata, safetensors' own layout
    s = make(tmp_path, 0, 0, 100 * CB)
    m = s.lookup("t", toks(4))
    assert m.tokens == 4 and m.tier == "l2"
    assert_restored(s, m, layers, 4)


@pytest.mark.parametrize(
    "path",
    ["direct", "promote", "partial"],  # read into the output / into a host buffer then L1 / part of a chunk
)
def test_l2_read_paths_are_exact_and_verified(tmp_path, path):
    layers = kv(10)
    s = make(tmp_path, 0, 0, 100 * CB)
    s.put("t", toks(10), layers)
    s.close()
    l1 = 100 * CB if path == "promote" else 0
    s = make(tmp_path, 0, l1, 100 * CB)
    n = 9 if path == "partial" else 10
    m = s.lookup("t", toks(n) + ([777] if path == "partial" else []))
    assert m.tokens == n and m.tier == "l2"
    assert_restored(s, m, layers, n)
    if path == "promote":
        assert s.lookup("t", toks(10)).tier == "l1"
        assert_restored(s, s.lookup("t", toks(10)), layers, 10)


@pytest.mark.parametrize("path", ["direct", "promote"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_bit_flip_fails_the_load_on_every_read_path(tmp_path, path, where):
    f = _one_file(tmp_path)
    data = bytearray(f.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    data[header_end + 5 if where == "first" else -10] ^= 0x10
    f.write_bytes(bytes(data))
    s = make(tmp_path, 0, 100 * CB if path == "promote" else 0, 100 * CB)
    m = s.lookup("t", toks(4))
    assert m.tokens == 4 and m.tier == "l2"
    r = s.load(m)
    with pytest.raises(KVLoadError):
        r.wait()
    with pytest.raises(KVLoadError):
        r.layer(0 if where == "first" else LAYOUT.num_layers - 1)
    assert s.lookup("t", toks(4)).tokens == 0 and len(quarantined(tmp_path)) == 1


def test_sync_put_writes_a_batch_durably_and_reports_each_failure(tmp_path, monkeypatch):
    """A synchronous put writes every chunk before fsyncing; one chunk's failed rename costs that chunk's
    L2 copy only, and leaves no temp file."""
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EIO, "injected")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    s = make(tmp_path, 0, 0, 100 * CB)
    layers = kv(12)
    s.put("t", toks(12), layers)
    monkeypatch.undo()
    st = s.stats()
    assert st.save_errors == 1 and st.tiers["l2"].entries == 2 and len(files(tmp_path)) == 2
    assert not list((tmp_path / "l2").rglob("*.tmp"))
    assert s.lookup("t", toks(12)).tokens == 4  # chunk 1 is missing, so the prefix stops after chunk 0
    assert_restored(s, s.lookup("t", toks(4)), layers, 4)


@pytest.mark.parametrize("l0", [100 * CB, 0])  # from memory, and straight from the L2 files
def test_load_with_capacity_leaves_room_after_the_restored_tokens(tmp_path, l0):
    store = make(tmp_path, l0=l0, l1=0)
    layers = kv(10)
    store.put("t", toks(10), layers)
    match = store.lookup("t", toks(10))
    restored = store.load(match, capacity=25)
    for i, (k, v) in enumerate(layers):
        bk, bv = restored.buffers(i)
        assert bk.shape[2] == bv.shape[2] == 25  # the caller appends here without reallocating
        assert torch.equal(bk[:, :, :10], k) and torch.equal(bv[:, :, :10], v)
        assert restored.layer(i)[0].shape[2] == 10
    restored.wait()


def test_an_uncounted_lookup_leaves_hits_and_misses_alone(tmp_path):
    store = make(tmp_path)
    store.put("t", toks(10), kv(10))
    before = store.stats()
    assert store.lookup("t", toks(10), count=False).tokens == 10
    assert store.lookup("t", toks(5, base=100), count=False).tokens == 0
    after = store.stats()
    assert after.hits == before.hits and after.misses == before.misses
    assert store.lookup("t", toks(10)).tokens == 10
    assert store.stats().hits["l0"] == before.hits["l0"] + 1


@pytest.mark.parametrize("l0", [100 * CB, 0])  # from memory, and straight from the L2 files
def test_load_into_caller_buffers_fills_them_in_place(tmp_path, l0):
    """A runner restores into its own KV slot (a row of a bigger pool): the restored KV lands in those
    very buffers, other rows of the pool are untouched, and buffers that cannot hold it are refused."""
    store = make(tmp_path, l0=l0, l1=0)
    layers = kv(10)
    store.put("t", toks(10), layers)
    match = store.lookup("t", toks(10))
    shape = (3, LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, 32, LAYOUT.head_dim)  # 3 slots of 32 tokens
    pool = torch.full(shape, -7.0)
    out = [(pool[1, i, 0].unsqueeze(0), pool[1, i, 1].unsqueeze(0)) for i in range(LAYOUT.num_layers)]
    restored = store.load(match, out=out)
    restored.wait()
    for i, (k, v) in enumerate(layers):
        bk, bv = restored.buffers(i)
        assert bk.data_ptr() == out[i][0].data_ptr() and bv.data_ptr() == out[i][1].data_ptr()
        assert torch.equal(pool[1, i, 0, :, :10], k[0]) and torch.equal(pool[1, i, 1, :, :10], v[0])
    assert (
        torch.all(pool[0] == -7.0) and torch.all(pool[2] == -7.0) and torch.all(pool[1, :, :, :, 10:] == -7.0)
    )
    too_short = [(t[0][:, :, :5], t[1][:, :, :5]) for t in out]
    with pytest.raises(ValueError, match="does not fit"):
        store.load(match, out=too_short)


@pytest.mark.parametrize("tier", ["l0", "l1", "l2"])
def test_a_chunk_used_in_part_restores_into_its_page(tmp_path, tier):
    """A match that ends inside a stored chunk restores that chunk's first tokens into the job's page
    (the whole stored layer is copied, a contiguous source; the page's tokens past the match are the
    job's to overwrite) and every full chunk into its own page, from each tier."""
    from kvtier import PagedTarget

    l0, l1, l2 = {"l0": (100 * CB, 0, 0), "l1": (0, 100 * CB, 0), "l2": (0, 0, 100 * CB)}[tier]
    s = make(tmp_path, l0=l0, l1=l1, l2=l2)
    layers = kv(3 * CHUNK, seed=5)
    s.put("t", toks(3 * CHUNK), layers)
    s.flush()
    q = toks(3 * CHUNK)
    q[CHUNK + 2] = 999  # differs inside chunk 1: 2 of its 4 tokens are reused
    m = s.lookup("t", q)
    assert m.tokens == CHUNK + 2 and m.tier == tier
    pool = torch.full((LAYOUT.num_layers, 3, 2, LAYOUT.num_kv_heads, CHUNK, LAYOUT.head_dim), 7.0)
    s.load(m, out=PagedTarget(pool, (2, 0))).wait()  # chunk 0 into page 2, chunk 1 into page 0
    for i, (k, v) in enumerate(layers):
        assert torch.equal(pool[i, 2, 0], k[0, :, :CHUNK]) and torch.equal(pool[i, 2, 1], v[0, :, :CHUNK])
        assert torch.equal(pool[i, 0, 0, :, :2], k[0, :, CHUNK : CHUNK + 2])
        assert torch.equal(pool[i, 0, 1, :, :2], v[0, :, CHUNK : CHUNK + 2])
        assert torch.equal(pool[i, 1], torch.full_like(pool[i, 1], 7.0))  # no chunk's page: untouched
    s.close()
