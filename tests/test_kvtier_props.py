"""Property test: under random put / lookup+load / pin / forget sequences with tight capacities, no tier
ever exceeds its capacity, every restored KV equals what was put, and pinned chunks stay put."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import KVLayout, KVStore, StoreConfig

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
CHUNK = 4
CB = CHUNK * LAYOUT.bytes_per_token
CONVS = 5


def conv_kv(c: int, n: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(c)
    shape = (1, 2, n, 8)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(2)]


KV = [conv_kv(c) for c in range(CONVS)]


def conv_tokens(c: int, n: int) -> list[int]:
    return [1000 * c + i for i in range(n)]


op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, CONVS - 1), st.integers(1, 16)),
    st.tuples(st.just("get"), st.integers(0, CONVS - 1), st.integers(1, 16)),
    st.tuples(st.just("pin"), st.integers(0, CONVS - 1), st.integers(1, 16)),
    st.tuples(st.just("unpin"), st.just(0), st.just(0)),
    st.tuples(st.just("forget"), st.integers(0, CONVS - 1), st.just(0)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    caps=st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 8)),
    ops=st.lists(op, min_size=1, max_size=25),
)
def test_capacity_never_exceeded_and_data_exact(caps, ops):
    with tempfile.TemporaryDirectory() as d:
        cfg = StoreConfig(
            caps[0] * CB, caps[1] * CB, caps[2] * CB, Path(d), chunk_tokens=CHUNK, async_save=False
        )
        s = KVStore(cfg, LAYOUT, "fp")
        pins = []
        for name, c, n in ops:
            ns = f"ns{c % 2}"
            if name == "put":
                s.put(ns, conv_tokens(c, n), KV[c], session=f"s{c}")
            elif name in ("get", "pin"):
                m = s.lookup(ns, conv_tokens(c, n))
                assert m.tokens <= n
                if name == "pin":
                    cm = s.acquire(m)
                    cm.__enter__()
                    pins.append((cm, m, c))
                r = s.load(m)
                for i, (k, v) in enumerate(KV[c]):
                    rk, rv = r.layer(i)
                    assert torch.equal(rk, k[:, :, : m.tokens]) and torch.equal(rv, v[:, :, : m.tokens])
            elif name == "unpin" and pins:
                pins.pop(0)[0].__exit__(None, None, None)
            elif name == "forget":
                s.forget_session(ns, f"s{c}")
            for t in s.stats().tiers.values():
                assert 0 <= t.used_bytes <= t.capacity_bytes
            for _, m, c in pins:  # pinned and not forgotten: still fully there
                if any(o == ("forget", c, 0) for o in ops):
                    continue
                assert s.lookup(m.namespace, conv_tokens(c, m.tokens)).tokens >= m.tokens
        s.close()
