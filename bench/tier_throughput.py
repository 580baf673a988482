"""Tier throughput of kvtier against the raw operation each tier wraps.

    python -m bench.tier_throughput [--reps 5] [--tokens 1024 4096]

SmolLM2-135M-sized KV (30 layers, 3 KV heads, head_dim 64, float32), chunks of 256 tokens.
- put L0 / L1: KVStore.put into that tier alone (the others' capacity 0, so no background L2 save
  competes), vs. raw = cloning every layer's K and V (what put must do: copy what it keeps).
- get L0 / L1: lookup + load + wait (every layer assembled into [1, heads, T, head_dim]), vs. the same
  raw clone.
- put L2: synchronous put (async_save=False: checksums, one file per chunk, temp + fsync + rename +
  folder fsync), vs. raw safetensors save_file of the whole KV in one file, with and without fsync; and,
  as a second, separately labelled baseline, save_file + fsync of one file per 256-token chunk (the
  same bytes in the same number of files and fsyncs as the store; chunk tensors sliced before timing).
- get L2: lookup + layer-wise load + per-layer checksum verification, vs. raw load_file + materializing
  every tensor (load_file maps the file lazily; the store must hand out private tensors).
Repetitions are interleaved (each rep runs every variant once) and medians are reported.
glibc is told to keep freed memory (mallopt) so that every variant, raw or not, reuses warm pages instead
of some paying fresh page faults depending on what ran just before it (a long-running server's steady state).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvtier import KVLayout, KVStore, StoreConfig

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32)
CHUNK = 256
BIG = 1 << 40


def keep_freed_memory() -> None:
    """glibc: never trim the heap nor serve big blocks by mmap, so freed buffers are reused warm."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_max = -1, -4
    libc.mallopt(m_trim_threshold, 1 << 30)
    libc.mallopt(m_mmap_max, 0)


def make_kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    shape = (1, LAYOUT.num_kv_heads, n, LAYOUT.head_dim)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(LAYOUT.num_layers)
    ]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def store(root: Path, tier: str) -> KVStore:
    caps = {"l0": (BIG, 0, 0), "l1": (0, BIG, 0), "l2": (0, 0, BIG)}[tier]
    return KVStore(StoreConfig(*caps, root / tier, chunk_tokens=CHUNK, async_save=False), LAYOUT, "bench")


def run_rep(stores: dict[str, KVStore], root: Path, n: int, rep: int, out: dict[str, list[float]]) -> None:
    layers = make_kv(n)
    tokens = list(range(rep * 100_000, rep * 100_000 + n))
    ns = f"rep{rep}"

    def raw_copy() -> None:
        [(k.clone(), v.clone()) for k, v in layers]

    out["raw copy"].append(timed(raw_copy))
    for tier in ("l0", "l1", "l2"):
        s = stores[tier]
        out[f"put {tier}"].append(timed(lambda s=s: s.put(ns, tokens, layers)))
        out[f"get {tier}"].append(timed(lambda s=s: s.load(s.lookup(ns, tokens)).wait()))
        assert s.lookup(ns, tokens).tier == tier
        s.forget_namespace(ns)
    raw = root / f"raw{rep}.safetensors"
    tensors = {f"{kv}.{i}": t[0] for i, pair in enumerate(layers) for kv, t in zip("kv", pair, strict=True)}
    out["raw save_file"].append(timed(lambda: save_file(tensors, str(raw))))
    raw.unlink()
    out["raw save_file+fsync"].append(timed(lambda: (save_file(tensors, str(raw)), fsync_file(raw))))
    out["raw load_file"].append(timed(lambda: [t.clone() for t in load_file(str(raw)).values()]))
    raw.unlink()
    chunk_files = [
        (
            root / f"raw{rep}-{s}.safetensors",
            {name: t[:, s : s + CHUNK].contiguous() for name, t in tensors.items()},
        )
        for s in range(0, n, CHUNK)
    ]

    def raw_per_chunk() -> None:
        for path, chunk in chunk_files:
            save_file(chunk, str(path))
            fsync_file(path)

    out[PER_CHUNK].append(timed(raw_per_chunk))
    for path, _ in chunk_files:
        path.unlink()


PER_CHUNK = f"raw save_file+fsync per {CHUNK}-token file"
ROWS = [
    ("L0 put", "put l0", "raw copy"),
    ("L0 get", "get l0", "raw copy"),
    ("L1 put", "put l1", "raw copy"),
    ("L1 get", "get l1", "raw copy"),
    ("L2 put", "put l2", "raw save_file+fsync"),
    ("L2 put (vs no fsync)", "put l2", "raw save_file"),
    ("L2 put (vs per-chunk files)", "put l2", PER_CHUNK),
    ("L2 get", "get l2", "raw load_file"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    args = ap.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    print("| tokens | op | kvtier GB/s | raw op | raw GB/s | ratio |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as d:
        root = Path(d)
        stores = {t: store(root, t) for t in ("l0", "l1", "l2")}
        for n in args.tokens:
            times: dict[str, list[float]] = defaultdict(list)
            for rep in range(args.reps + 1):
                run_rep(stores, root, n, rep, times if rep else defaultdict(list))  # rep 0 warms up
            gb = n * LAYOUT.bytes_per_token / 1e9
            for label, ours, raw in ROWS:
                t_ours, t_raw = statistics.median(times[ours]), statistics.median(times[raw])
                print(
                    f"| {n} | {label} | {gb / t_ours:.2f} | {raw} | {gb / t_raw:.2f} | {t_raw / t_ours:.2f} |",
                    flush=True,
                )
        for s in stores.values():
            s.close()


if __name__ == "__main__":
    main()
