"""What kvtier's transfers cost on the engine's device: GB/s for each move of KV, what `put` costs its
caller, and whether a restore's layer i+1 arrives while layer i computes.

    python -m bench.tier_transfers [--tokens 8192] [--reps 3] [--layout 8b|135m] [--device auto]
        [--tiers l0,l1,l2] [--no-puts]      # e.g. --tiers l2 --no-puts: L2's moves alone

KV of a model's shape (8b: Llama-3.1-8B's, 32 layers x 8 K/V heads x 128, bfloat16, 128 KiB a token;
135m: SmolLM2-135M's), chunks of 256 tokens, restored into a page pool as the engine's jobs are
(PagedTarget), saved from pages as the engine saves them (put blocks). Per repetition (medians printed):

- L0 -> pages, L1 -> pages, L2 -> pages (warm: the files in the page cache; cold: dropped from it
  first): load of `tokens` tokens until every layer is in the pages (the copies done on the device);
- pages -> L1, pages -> L2: put until its copies are done (L1: the pinned host buffers filled; L2: the
  files written and fsynced, async saving drained);
- put's own time (what the engine's save hand-off waits for) with the device busy, for L0 only, L1
  only, L2 only and L1 of 0 beside L0: it must not wait for the compute queued before it;
- overlap (CUDA): a restore from L1 into pages while a model-like step computes layer by layer, each
  layer after that layer's copy (RestoredKV.wait_layer): each layer's copy end and compute start/end on
  one clock, and the step's time against copying everything first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from kvtier import KVLayout, KVStore, PagedTarget, StoreConfig

LAYOUTS = {
    "8b": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
    "135m": KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16),
}
CHUNK = 256
BIG = 1 << 40
# The pinned pool, in turns of KV: a turn in L1, one load's staging and a save's (a server's is its L1).
POOL = 3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pool(layout: KVLayout, device: torch.device, pages: int) -> torch.Tensor:
    shape = (layout.num_layers, pages, 2, layout.num_kv_heads, CHUNK, layout.head_dim)
    return (
        torch.randn(shape, device=device).to(layout.dtype)
        if device.type == "cuda"
        else torch.zeros(shape, dtype=layout.dtype)
    )


def make_store(
    root: Path, layout: KVLayout, device: torch.device, l0: int, l1: int, l2: int, pinned: int = 0
) -> KVStore:
    """A store of these capacities; on CUDA its pinned pool is `pinned` bytes (the tiers here are
    unbounded: a server's pool follows its L1), grown before anything is timed, as a server's is."""
    config = StoreConfig(
        l0, l1, l2, root, chunk_tokens=CHUNK, device=device, async_save=True, pinned_pool_bytes=pinned
    )
    store = KVStore(config, layout, "bench")
    store.wait_pinned_pool()
    return store


def blocks(src: torch.Tensor, n_pages: int) -> list[torch.Tensor]:
    return [src[:, p] for p in range(n_pages)]


def drop_page_cache(root: Path) -> None:
    for path in root.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def busy(device: torch.device, ms: float = 200.0) -> None:
    """Keep the current stream computing for about `ms`: one spinning kernel (torch.cuda._sleep), not a
    queue of small ones, which could fill the device's launch queue and make the next launch on any
    stream wait for a slot, so that a `put` would seem to wait for the compute when it does not."""
    if device.type != "cuda":
        return
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_ms = cycles / max(start.elapsed_time(end), 0.01)
    torch.cuda._sleep(int(ms * per_ms))


def run(
    tokens: int,
    reps: int,
    layout: KVLayout,
    device: torch.device,
    tiers: tuple[str, ...] = ("l0", "l1", "l2"),
    puts: bool = True,
) -> None:
    n_pages = tokens // CHUNK
    ids = list(range(tokens))
    nbytes = tokens * layout.bytes_per_token
    src = pool(layout, device, n_pages)
    dst = pool(layout, device, n_pages)
    target = PagedTarget(dst, tuple(range(n_pages)))
    out: dict[str, list[float]] = defaultdict(list)
    put_cases = (
        (
            ("L0 only", (BIG, 0, 0)),
            ("L1 only", (0, BIG, 0)),
            ("L2 only", (0, 0, BIG)),
            ("L0 + L1 of 0", (1 << 20, 0, BIG)),
            ("L2 full", (0, 0, nbytes)),
        )
        if puts
        else ()
    )
    with tempfile.TemporaryDirectory(prefix="tier-transfers-") as tmp:
        root = Path(tmp)
        for rep in range(reps):
            ns = f"rep{rep}"
            for tier, caps in (("l0", (BIG, 0, 0)), ("l1", (0, BIG, 0)), ("l2", (0, 0, BIG))):
                if tier not in tiers:
                    continue
                store = make_store(root / f"{tier}{rep}", layout, device, *caps, pinned=POOL * nbytes)
                sync(device)
                t0 = time.perf_counter()
                store.put(ns, ids, blocks=blocks(src, n_pages))
                store.wait_copies()  # L1: the pinned host buffers filled
                store.flush()  # L2: the files written
                sync(device)
                if tier != "l0":
                    out[f"pages -> {tier} GB/s"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                for cold in (False, True) if tier == "l2" else (False,):
                    if cold:
                        drop_page_cache(root / f"{tier}{rep}")
                    match = store.lookup(ns, ids)
                    assert match.tokens == tokens - 1 or match.tokens == tokens, match.tokens
                    sync(device)
                    t0 = time.perf_counter()
                    store.load(match, out=target).wait()
                    sync(device)
                    label = f"{tier} -> pages" + (" cold" if cold else " warm" if tier == "l2" else "")
                    out[f"{label} GB/s"].append(
                        match.tokens * layout.bytes_per_token / (time.perf_counter() - t0) / 1e9
                    )
                store.close()
            for name, caps in put_cases:
                store = make_store(
                    root / f"put{rep}{name.replace(' ', '')}", layout, device, *caps, pinned=POOL * nbytes
                )
                if name == "L2 full":  # a turn already fills it: the put evicts as many files as it adds
                    store.put(f"{ns}-before", ids, blocks=blocks(src, n_pages))
                    store.flush()
                busy(device)
                t0 = time.perf_counter()
                store.put(ns, ids, blocks=blocks(src, n_pages))
                out[f"put returns ({name}, device busy) ms"].append((time.perf_counter() - t0) * 1000)
                store.flush()
                sync(device)
                store.close()
            if device.type == "cuda":
                overlap(
                    root / f"overlap{rep}", layout, device, src, dst, n_pages, out, verbose=rep == reps - 1
                )
    print(f"{tokens} tokens ({nbytes / 1e9:.2f} GB of KV), {layout.describe()}, {device}, medians of {reps}:")
    for name, values in out.items():
        print(f"  {name:44s} {statistics.median(values):10.2f}")
    if device.type == "cuda":
        print_pinned_allocations()


def print_pinned_allocations() -> None:
    """What growing torch's pinned host pool cost over the run (every L1 buffer and staging buffer comes
    from it: a cold allocation is a cudaHostAlloc, seen by whoever asked, a put or a load)."""
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    if "num_host_alloc" not in stats:
        print("pinned allocations: torch does not report them (torch.cuda.host_memory_stats)")
        return
    print(
        f"pinned allocations: {stats['num_host_alloc']} blocks grown, "
        f"{stats.get('allocated_bytes.peak', 0) / 1e9:.2f} GB at the peak, "
        f"{stats.get('host_alloc_time.total', 0) / 1000:.1f} ms in cudaHostAlloc in all "
        f"(longest {stats.get('host_alloc_time.max', 0) / 1000:.2f} ms)"
    )


def overlap(
    root: Path,
    layout: KVLayout,
    device: torch.device,
    src: torch.Tensor,
    dst: torch.Tensor,
    n_pages: int,
    out: dict[str, list[float]],
    verbose: bool,
) -> None:
    """A restore from L1 beside a layer-by-layer compute: per layer, the compute stream waits for that
    layer's copy, then runs a product sized like an 8B layer's at a short prompt."""
    ids = list(range(n_pages * CHUNK))
    store = make_store(root, layout, device, 0, BIG, 0, pinned=POOL * src.nbytes)
    store.put("o", ids, blocks=blocks(src, n_pages))
    store.flush()
    sync(device)
    x = torch.randn(64, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096 * 6, device=device, dtype=torch.bfloat16)

    def compute(i: int) -> None:
        y = x
        for _ in range(4):
            y = (y @ w)[:, :4096]

    clock = torch.cuda.Event(enable_timing=True)
    marks = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(layout.num_layers)
    ]
    match = store.lookup("o", ids)
    sync(device)
    clock.record()
    t0 = time.perf_counter()
    restored = store.load(match, out=PagedTarget(dst, tuple(range(n_pages))))
    for i in range(layout.num_layers):
        restored.wait_layer(i)
        marks[i][0].record()
        compute(i)
        marks[i][1].record()
    sync(device)
    overlapped = time.perf_counter() - t0
    restored.wait()
    copy_done = [clock.elapsed_time(e) if e is not None else None for e in restored.layer_events()]
    # copying everything first, then computing every layer: the serial baseline
    match = store.lookup("o", ids)
    sync(device)
    t0 = time.perf_counter()
    store.load(match, out=PagedTarget(dst, tuple(range(n_pages)))).wait()
    sync(device)
    for i in range(layout.num_layers):
        compute(i)
    sync(device)
    serial = time.perf_counter() - t0
    out["overlap: restore+compute layer-wise ms"].append(overlapped * 1000)
    out["overlap: restore, then compute ms"].append(serial * 1000)
    if verbose:
        print(
            "layer-wise restore from L1 (ms from the load's start): layer, copy done, compute start, compute end"
        )
        for i, (start, end) in enumerate(marks):
            done = f"{copy_done[i]:.2f}" if copy_done[i] is not None else "-"
            print(f"  {i:3d} {done:>8s} {clock.elapsed_time(start):8.2f} {clock.elapsed_time(end):8.2f}")
    store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="8b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tiers", default="l0,l1,l2", help="the tiers whose moves are measured (l2: L2's alone)")
    ap.add_argument("--no-puts", action="store_true", help="skip what put costs its caller")
    a = ap.parse_args()
    device = torch.device(
        "cuda"
        if a.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if a.device == "auto"
        else a.device
    )
    tiers = tuple(t for t in a.tiers.split(",") if t)
    if not set(tiers) <= {"l0", "l1", "l2"}:
        ap.error(f"--tiers takes l0, l1, l2; got {a.tiers}")
    run(a.tokens // CHUNK * CHUNK, a.reps, LAYOUTS[a.layout], device, tiers, not a.no_puts)


if __name__ == "__main__":
    main()
