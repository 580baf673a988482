"""kvtier on CUDA: restores and demotions read a chunk only after the stream that wrote it, a load
settles once its copies are done on the device, and the device's free memory is readable. Every test
but the first needs a GPU (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from kvtier import available_device_memory_bytes
from tests.test_kvtier import CB, CHUNK, kv, make, toks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BUSY_CYCLES = 500_000_000  # a kernel of roughly a quarter second: the writer's stream is still busy


def test_device_memory_is_not_asked_of_a_cpu_device():
    assert available_device_memory_bytes("cpu") is None


def _put_from_a_busy_stream(store, layers) -> None:
    """Store `layers` from a side stream whose earlier work is still running: the chunks' copies into
    L0 are queued behind it, so their bytes arrive well after put() returns. A first put of the same
    size (then forgotten) leaves the allocator blocks for that stream, as a running server has: an
    allocation that must ask the driver for memory may wait for the device."""
    side = torch.cuda.Stream()
    device_layers = [(k.cuda(), v.cuda()) for k, v in layers]
    with torch.cuda.stream(side):
        store.put("warm", toks(2 * CHUNK, base=10_000), device_layers)
    store.flush()
    store.forget_namespace("warm")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)
        store.put("t", toks(2 * CHUNK), device_layers)
    assert not side.query()  # the copies are still queued: the race is on


def _restores_exactly(store, match, layers) -> None:
    """The match's KV, restored layer by layer, is `layers` bit for bit; the load then settles."""
    restored = store.load(match)
    for i, (k, v) in enumerate(layers):
        rk, rv = restored.layer(i)
        assert torch.equal(rk.cpu(), k) and torch.equal(rv.cpu(), v)
    restored.wait()


@cuda
def test_a_restore_reads_l0_chunks_only_after_the_stream_that_wrote_them(tmp_path):
    layers = kv(2 * CHUNK, seed=11)
    store = make(tmp_path, l0=8 * CB, l1=0, l2=0, device="cuda")  # L0 only: put never waits for a disk
    _put_from_a_busy_stream(store, layers)
    match = store.lookup("t", toks(2 * CHUNK))
    assert match.tier == "l0"
    _restores_exactly(store, match, layers)
    store.close()


@cuda
def test_a_demotion_copies_an_l0_chunk_only_after_the_stream_that_wrote_it(tmp_path):
    layers = kv(2 * CHUNK, seed=12)
    store = make(tmp_path, l0=8 * CB, l1=8 * CB, l2=0, device="cuda")
    _put_from_a_busy_stream(store, layers)
    assert store.shed_device_memory() == 2 * CB  # L0 -> L1 at once, while the writer is still busy
    match = store.lookup("t", toks(2 * CHUNK))
    assert match.tier == "l1"
    _restores_exactly(store, match, layers)
    store.close()


@cuda
@pytest.mark.parametrize("into", ["own", "caller"])
def test_a_settled_restore_has_finished_its_copies(tmp_path, into):
    """`ready` means the targets are no longer written: a cancelled job may hand its slot to another."""
    layers = kv(4 * CHUNK, seed=13)
    store = make(tmp_path, l0=0, l1=8 * CB, l2=8 * CB, device="cuda")
    store.put("t", toks(4 * CHUNK), layers)
    match = store.lookup("t", toks(4 * CHUNK))
    out = None
    if into == "caller":
        shape = (1, layers[0][0].shape[1], 4 * CHUNK, layers[0][0].shape[3])
        out = [(torch.empty(shape, device="cuda"), torch.empty(shape, device="cuda")) for _ in layers]
    restored = store.load(match, out=out)
    assert restored.wait_ready(30)
    events = list(restored._events)  # each layer's copy-stream event
    assert all(e is not None and e.query() for e in events)
    for i, (k, _) in enumerate(layers):
        assert torch.equal(restored.layer(i)[0].cpu(), k)
    store.close()


@cuda
def test_device_memory_falls_by_what_is_held():
    device = torch.device("cuda")
    before = available_device_memory_bytes(device)
    assert (
        before is not None and 0 < before <= torch.cuda.mem_get_info(device)[1] + torch.cuda.memory_reserved()
    )
    held = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    after = available_device_memory_bytes(device)
    assert after is not None and before - after >= 0.9 * held.numel()
    del held
    freed = available_device_memory_bytes(device)
    assert freed is not None and freed - after >= 0.9 * (256 << 20)  # the allocator's cache counts as free


def _pages(layers, n_pages: int) -> torch.Tensor:
    """`layers` laid out as a page pool's pages ([layers, pages, 2, heads, CHUNK, dim]) on CUDA."""
    k = torch.stack([k[0] for k, _ in layers])  # [layers, heads, tokens, dim]
    v = torch.stack([v[0] for _, v in layers])
    both = torch.stack((k, v), dim=1)  # [layers, 2, heads, tokens, dim]
    n_layers, _, heads, _, dim = both.shape
    pages = both.view(n_layers, 2, heads, n_pages, CHUNK, dim).permute(0, 3, 1, 2, 4, 5)
    return pages.contiguous().cuda()


@cuda
@pytest.mark.parametrize("tiers", ["l0 only", "l1 of 0", "l1 only"])
def test_a_put_of_pages_never_waits_for_the_compute_and_restores_into_pages(tmp_path, tiers):
    """The engine's save (pages as chunk blocks) from a stream still busy computing returns before that
    compute is done, whatever the tiers (L1 of 0: the disk's copy is staged on a side stream); the KV
    then restores into another pool's pages bit for bit."""
    from kvtier import PagedTarget

    l0, l1 = {"l0 only": (8 * CB, 0), "l1 of 0": (1 * CB, 0), "l1 only": (0, 8 * CB)}[tiers]
    store = make(tmp_path, l0=l0, l1=l1, l2=8 * CB, device="cuda", async_save=True)
    layers = kv(2 * CHUNK, seed=21)
    src = _pages(layers, 2)
    blocks = [src[:, p] for p in range(2)]
    store.put("warm", toks(2 * CHUNK, base=10_000), blocks=blocks)  # the allocator's blocks, as in a server
    store.flush()
    store.forget_namespace("warm")
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    store.put("t", toks(2 * CHUNK), blocks=blocks)
    assert not torch.cuda.current_stream().query()  # put returned while the compute before it still ran
    store.flush()
    store.wait_copies()
    dst = torch.zeros_like(src)
    match = store.lookup("t", toks(2 * CHUNK))
    assert match.tokens >= 2 * CHUNK - 1
    store.load(match, out=PagedTarget(dst, (1, 0))).wait()  # chunk 0 into page 1, chunk 1 into page 0
    n = match.tokens - CHUNK
    assert torch.equal(dst[:, 1], src[:, 0]) and torch.equal(dst[:, 0, :, :, :n], src[:, 1, :, :, :n])
    store.close()


@cuda
@pytest.mark.parametrize("hint", ["ttft_priority", "throughput"])
def test_a_put_of_pages_copies_on_the_device_only_what_l0_keeps(tmp_path, hint):
    """A turn longer than L0: only the chunks L0 keeps (the chain's head; none with the throughput
    hint, which keeps L0 for queued jobs) are copied on the device, the rest go straight from the pages
    to pinned host memory on the store's stream, after the compute, and the caller gets the event
    after which its pages are no longer read. Copying every chunk on the device first would take 4
    chunks of device memory here (3.75 GB at 30k tokens of an 8B model); the KV restores bit for bit."""
    from kvtier import PagedTarget

    n = 4
    store = make(tmp_path, l0=1 * CB, l1=8 * CB, l2=0, device="cuda", placement_hint=hint)
    src = _pages(kv(n * CHUNK, seed=71), n)
    blocks = [src[:, p] for p in range(n)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    reads: list[torch.cuda.Event] = []
    torch.cuda._sleep(BUSY_CYCLES)
    store.put("t", toks(n * CHUNK), blocks=blocks, on_blocks_read=reads.append)
    assert len(reads) == 1 and not reads[0].query()  # queued behind the compute, and put did not wait
    on_device = 1 if hint == "ttft_priority" else 0
    # L0's chunk, plus one chunk at a time packed on the store's stream (a page is a strided view)
    assert torch.cuda.max_memory_allocated() - base <= (on_device + 1) * CB
    reads[0].synchronize()
    store.wait_copies()
    match = store.lookup("t", toks(n * CHUNK))
    assert match.tokens >= n * CHUNK - 1
    core = store._core
    held = [(core.memory_tier_of(c.key).name, core.memory_copy(c.key).buf) for c in match.chunks]
    assert [name for name, _ in held] == ["l0"] * on_device + ["l1"] * (n - on_device)
    assert all(buf.is_pinned() for name, buf in held if name == "l1")
    dst = torch.zeros_like(src)
    store.load(match, out=PagedTarget(dst, tuple(range(n)))).wait()
    m = match.tokens - (n - 1) * CHUNK
    assert torch.equal(dst[:, : n - 1], src[:, : n - 1]) and torch.equal(
        dst[:, -1, :, :, :m], src[:, -1, :, :, :m]
    )
    store.close()


@cuda
def test_a_put_of_pages_without_a_callback_orders_the_callers_stream_after_its_reads(tmp_path):
    """Without `on_blocks_read` nobody would know when the pages may be written again: the caller's
    stream then waits for the reads (on the device), so what it queues next writes after them; chunks
    no tier and no disk could take are not copied at all."""
    store = make(tmp_path, l0=0, l1=8 * CB, l2=0, device="cuda")
    src = _pages(kv(2 * CHUNK, seed=72), 2)
    side = torch.cuda.Stream()
    with torch.cuda.stream(store._page_reads.get(torch.device("cuda"))):
        torch.cuda._sleep(BUSY_CYCLES)  # the store's reads wait behind this: the race below is certain
    with torch.cuda.stream(side):
        store.put("t", toks(2 * CHUNK), blocks=[src[:, p] for p in range(2)])
        src.fill_(0)  # the caller reuses its pages at once
    store.wait_copies()
    restored = store.load(store.lookup("t", toks(2 * CHUNK)))
    assert not torch.all(restored.layer(0)[0] == 0)  # the copy read the pages before the fill
    restored.wait()
    store.close()
    nowhere = make(tmp_path / "nowhere", l0=1 * CB, l1=0, l2=0, device="cuda")
    src = _pages(kv(3 * CHUNK, seed=73), 3)
    reads: list[torch.cuda.Event] = []
    nowhere.put("t", toks(3 * CHUNK), blocks=[src[:, p] for p in range(3)], on_blocks_read=reads.append)
    assert reads == [] and nowhere.lookup("t", toks(3 * CHUNK)).tokens == CHUNK  # L0 took the head only
    nowhere.close()


@cuda
def test_side_streams_are_kept_and_restores_have_a_high_priority_one_per_thread():
    """torch.cuda.Stream() hands out pooled streams in turn: an owner's stream must stay its own however
    many streams are taken since, and a load thread's restores must not share another's."""
    import threading

    from kvtier.chunk import SideStreams

    moves = SideStreams()
    first = moves.get(torch.device("cuda"))
    for _ in range(40):  # the pool (32 a priority) turns round
        torch.cuda.Stream()
    assert moves.get(torch.device("cuda", torch.cuda.current_device())) == first
    restores = SideStreams(priority=-1, per_thread=True)
    mine = restores.get(torch.device("cuda"))
    theirs: list[torch.cuda.Stream] = []
    thread = threading.Thread(target=lambda: theirs.append(restores.get(torch.device("cuda"))))
    thread.start()
    thread.join()
    assert restores.get(torch.device("cuda")) == mine and theirs[0] != mine
    assert mine.priority < first.priority


@cuda
def test_a_store_moves_and_restores_on_its_own_streams(tmp_path, monkeypatch):
    """A put into L1 copies on L1's stream, a restore on its load thread's high-priority stream: no copy
    of the store takes one of torch's pooled streams."""
    import threading

    from kvtier.chunk import SideStreams

    taken: list[tuple[int, str]] = []
    real_get, real_stream = SideStreams.get, torch.cuda.Stream
    inside = threading.local()  # SideStreams.get itself takes its streams once from the pool

    def get(self, device):
        taken.append((self._priority, threading.current_thread().name))
        inside.get = True
        try:
            return real_get(self, device)
        finally:
            inside.get = False

    def pooled(*args, **kwargs):
        # torch.cuda.current_stream() and default_stream() wrap an existing stream through the same name,
        # by stream_id: that is no stream taken from the pool
        taking = "stream_id" not in kwargs
        if (
            taking
            and threading.current_thread().name.startswith("kvtier")
            and not getattr(inside, "get", False)
        ):
            raise AssertionError("a store's copy took one of torch's pooled streams")
        return real_stream(*args, **kwargs)

    store = make(tmp_path, l0=0, l1=8 * CB, l2=0, device="cuda")
    monkeypatch.setattr(SideStreams, "get", get)
    monkeypatch.setattr(torch.cuda, "Stream", pooled)
    layers = kv(2 * CHUNK, seed=61)
    store.put("t", toks(2 * CHUNK), [(k.cuda(), v.cuda()) for k, v in layers])
    assert (0, threading.current_thread().name) in taken  # the put's moves into L1
    _restores_exactly(store, store.lookup("t", toks(2 * CHUNK)), layers)
    assert any(p < 0 and name.startswith("kvtier-load") for p, name in taken), taken
    store.close()


@cuda
def test_a_chunk_prefetched_from_disk_is_pinned_in_l1(tmp_path):
    """L1 is page-locked memory on CUDA (copies to the device at full speed, never staged by the
    driver): a chunk the prefetch reads from L2 lands there pinned, not in pageable memory."""
    layers = [(k.cuda(), v.cuda()) for k, v in kv(2 * CHUNK, seed=31)]
    store = make(tmp_path, l0=0, l1=4 * CB, l2=8 * CB, device="cuda")
    store.put("t", toks(2 * CHUNK), layers)
    store.close()
    store = make(tmp_path, l0=0, l1=4 * CB, l2=8 * CB, device="cuda")  # a restart: only L2 holds it
    match = store.lookup("t", toks(2 * CHUNK), count=False)
    assert match.tier == "l2"
    store.prefetch(match)
    assert store.wait_prefetched(10)
    l1 = store._core.memory[-1]
    held = [l1.read(c.key) for c in match.chunks]
    assert all(h is not None and h.buf.is_pinned() for h in held)
    store.close()


@cuda
def test_a_save_queued_behind_the_disk_holds_the_host_copy_not_the_device_chunk(tmp_path):
    """With L0 of 0 a put's chunks go to L1; a save waiting in the queue writes L1's pinned copy, so no
    device memory outside every budget is held meanwhile, and the file holds the KV bit for bit."""
    import threading

    from tests.test_kvtier import GatedFileTier, own

    gate, writing = threading.Event(), threading.Event()
    gated = own(GatedFileTier, gate=gate, writing=writing)
    store = make(
        tmp_path, l0=0, l1=8 * CB, l2=8 * CB, device="cuda", async_save=True, save_workers=1,
        tiers={"l2": gated},
    )  # fmt: skip
    layers = kv(2 * CHUNK, seed=41)
    store.put("t", toks(2 * CHUNK), [(k.cuda(), v.cuda()) for k, v in layers])
    assert writing.wait(10)  # the only save worker holds the first chunk at the gate
    backing = store._core.backing
    keys = [c.key for c in store.lookup("t", toks(2 * CHUNK), count=False).chunks]
    assert not backing.in_flight(keys[1]).buf.is_cuda  # the queued save: the host copy
    gate.set()
    store.flush()
    store.close()
    store = make(tmp_path, l0=0, l1=0, l2=8 * CB, device="cuda")  # a restart: the files only
    _restores_exactly(store, store.lookup("t", toks(2 * CHUNK)), layers)
    store.close()


@cuda
def test_the_pinned_pool_is_grown_at_start_so_a_put_into_l1_allocates_none(tmp_path):
    """Growing torch's pinned pool is a cudaHostAlloc paid by whoever asks: a CUDA store grows it by
    L1's chunks on a thread at start, and a put whose chunks go to L1 then takes cached blocks."""
    torch.cuda.init()  # the host allocator reports nothing before CUDA is initialised
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or "num_host_alloc" not in stats():
        pytest.skip("this torch does not count its pinned allocations")
    from kvtier.pinned_pool import empty_host_cache

    empty_host_cache()  # what earlier tests left cached would hide a pool never grown
    store = make(tmp_path, l0=0, l1=8 * CB, l2=0, device="cuda")
    assert store.wait_pinned_pool(60)
    assert store._pinned_pool.grown == 8  # L1's chunks, no staging without L2
    grown = stats()["num_host_alloc"]
    layers = [(k.cuda(), v.cuda()) for k, v in kv(2 * CHUNK, seed=51)]
    store.put("t", toks(2 * CHUNK), layers)
    store.wait_copies()
    assert store.lookup("t", toks(2 * CHUNK)).tier == "l1"
    assert stats()["num_host_alloc"] == grown
    store.close()


def test_a_put_copies_to_the_host_only_what_a_host_tier_or_the_save_queue_can_take(tmp_path):
    """The chunks past L0's head are page-locked host copies on CUDA (put's _copy_blocks): as many as
    L1 holds, or as the save queue takes after the head's saves, never more (torch's pinned cache
    would keep the memory of chunks dropped at once). The rule runs on CUDA stores; here L0 is left
    out (on a CPU store it is host memory too)."""
    l1_only = make(tmp_path / "a", l0=0, l1=2 * CB, l2=0)
    assert l1_only._host_keeps(head=1, rest=10) == 2
    queue = make(tmp_path / "b", l0=0, l1=0, l2=64 * CB, async_save=True, save_queue_chunks=3)
    assert queue._host_keeps(head=1, rest=10) == 3  # 3 queued + 1 writing, less the head's save
    assert queue._host_keeps(head=1, rest=2) == 2
    written_at_once = make(tmp_path / "c", l0=0, l1=0, l2=64 * CB)  # put writes before it returns
    assert written_at_once._host_keeps(head=1, rest=10) == 10
    for store in (l1_only, queue, written_at_once):
        store.close()
