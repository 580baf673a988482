"""Truncation and positional decoupling in the engine, on the tiny random Llama (no real model).

- The cut is stable: a growing conversation cuts rarely, and every turn between cuts starts with the
  previous turn's prompt (an ordinary prefix hit).
- A truncating turn with decouple moves the kept turns' stored KV: in layer 0, whose K/V depend only on
  the token and its position, the moved KV equals a recompute of the truncated prompt to float rounding,
  which checks the alignment (token level, mid-chunk) and the rotation together.
"""

from __future__ import annotations

import pytest
import torch

from engine_api.prompt import ANSWER_ROOM, HEADROOM, fit_history, render_prompt
from engine_api.sampling import SamplingParams
from engine_api.turn import Finished, FirstToken, GenerationRequest, TextDelta
from kvtier import KVStore, StoreConfig
from local_runner.engine import EmbeddedEngine
from local_runner.realign import find_realignment
from proxy.local.config import engine_config
from tests.rendering import render
from tests.tiny_model import tiny_llama, tiny_loaded, tiny_tokenizer

LIMIT = 240
SYSTEM = {"role": "system", "content": "You are terse."}


def user(i: int) -> dict:
    return {"role": "user", "content": f"Question {i}, tell me about item number {i}, please."}


def test_the_cut_is_stable_as_the_conversation_grows():
    tok = tiny_tokenizer()
    history = [SYSTEM]
    previous: list[int] | None = None
    cuts = []
    for i in range(40):
        history.append(user(i))
        ids, dropped = fit_history(tok, history, 600, reserve=8)
        assert len(ids) + 8 <= 600
        text = tok.decode(ids)
        assert text.startswith("<system>You are terse.") and f"Question {i}," in text
        if previous is not None and ids[: len(previous)] != previous:
            cuts.append(i)
            assert dropped > 0 and len(ids) <= 600 * (1 - ANSWER_ROOM - HEADROOM)
        answer = {"role": "assistant", "content": f"Item {i} is fine."}
        history.append(answer)
        # The next turn must start with this turn's prompt and its answer to be a plain hit.
        previous = ids + tok.encode(answer["content"] + "\n", add_special_tokens=False)
    assert cuts, "the conversation never overflowed: the test checks nothing"
    assert all(b - a >= 3 for a, b in zip(cuts, cuts[1:], strict=False)), (
        cuts
    )  # 150 tokens of headroom: 2 turns


def test_a_conversation_that_fits_is_not_touched():
    tok = tiny_tokenizer()
    history = [SYSTEM, user(0), {"role": "assistant", "content": "ok"}, user(1)]
    assert fit_history(tok, history, LIMIT, reserve=8) == (render_prompt(tok, history), 0)


def test_realignment_finds_the_kept_run_mid_chunk():
    previous = [1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 24, 30]
    prompt = [1, 2, 3, 20, 21, 22, 23, 24, 30, 40, 41]
    found = find_realignment(prompt, previous)
    assert found is not None and (found.keep, found.src, found.n, found.shift) == (3, 7, 6, 4)
    assert found.within(10) is not None and found.within(10).n == 3  # the store holds only 10 tokens
    assert find_realignment([1, 2, 3, 9], previous) is None


@pytest.fixture
def lm():
    return tiny_loaded(model=tiny_llama(layers=2))


def store_for(lm, tmp_path) -> KVStore:
    mb = 1 << 20
    return KVStore(
        StoreConfig(64 * mb, 64 * mb, 64 * mb, tmp_path, chunk_tokens=16), lm.layout, lm.fingerprint
    )


async def run(
    engine: EmbeddedEngine, ids: list[int], ns: str, previous_keys=()
) -> tuple[str, FirstToken, Finished]:
    job = engine.submit(
        GenerationRequest(
            "tiny",
            ids,
            SamplingParams(max_tokens=8, temperature=0),
            namespace=ns,
            previous_keys=previous_keys,
        )
    )
    text, first, end = [], None, None
    async for ev in job.events():
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, FirstToken):
            first = ev
        elif isinstance(ev, Finished):
            end = ev
    assert first is not None and end is not None
    return "".join(text), first, end


async def converse_until_truncated(engine: EmbeddedEngine, ns: str):
    """Turns with the engine's own answers until one drops history; returns that turn's
    (prompt ids, FirstToken) and the turn after it."""
    history, keys, out = [SYSTEM], [], []
    for i in range(30):
        history.append(user(i))
        rendered = render(engine, "tiny", history, reserve=8)
        answer, first, end = await run(engine, rendered.ids, ns, keys if rendered.dropped_messages else ())
        out.append((rendered, first))
        history.append({"role": "assistant", "content": answer})
        keys = end.chunk_keys
        if len(out) >= 2 and out[-2][0].dropped_messages == 0 and rendered.dropped_messages:
            history.append(user(100))
            nxt = render(engine, "tiny", history, reserve=8)
            _, first_next, _ = await run(engine, nxt.ids, ns, keys)
            return rendered.ids, first, nxt, first_next
    raise AssertionError("never truncated")


def layer0(store: KVStore, ns: str, ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    match = store.lookup(ns, ids[:n], count=False)
    assert match.tokens == n
    k, v = store.load(match).layer(0)
    return k.clone(), v.clone()


async def test_truncated_turn_moves_the_kept_kv_like_a_recompute(lm, tmp_path):
    store = store_for(lm, tmp_path)
    engine = EmbeddedEngine(
        {"tiny": lm},
        {"tiny": store},
        config=engine_config(max_context_tokens=LIMIT, truncate_on_overflow=True, decouple=True),
    ).start()
    try:
        ids, first, nxt, first_next = await converse_until_truncated(engine, "a")
        assert first.position_shift > 0
        system_len = len(render_prompt(lm.tokenizer, [SYSTEM]))
        assert first.reused_tokens > system_len
        assert sum(first.tiers.values()) == first.reused_tokens and first.tier == "l0"
        # The turn after is a plain prefix hit on the saved truncated sequence.
        assert nxt.ids[: len(ids)] == ids and first_next.position_shift == 0
        assert first_next.reused_tokens >= len(ids)
        assert engine.stats().shifted_turns == 1 and engine.stats().shifted_tokens > 0
        # A recompute of the truncated prompt by another tenant (nothing to reuse there).
        _, other, _ = await run(engine, ids, "b")
        assert other.reused_tokens == 0 and other.position_shift == 0
        n = first.reused_tokens
        k_moved, v_moved = layer0(store, "a", ids, n)
        k_exact, v_exact = layer0(store, "b", ids, n)
        # Float rounding only (the two were computed in prefill steps of different sizes).
        assert float((v_moved - v_exact).norm() / v_exact.norm()) <= 1e-5
        assert float((k_moved - k_exact).norm() / k_exact.norm()) <= 1e-4
    finally:
        engine.close()


async def test_without_decouple_a_truncated_turn_recomputes(lm, tmp_path):
    store = store_for(lm, tmp_path)
    engine = EmbeddedEngine(
        {"tiny": lm},
        {"tiny": store},
        config=engine_config(max_context_tokens=LIMIT, truncate_on_overflow=True, decouple=False),
    ).start()
    try:
        ids, first, nxt, first_next = await converse_until_truncated(engine, "a")
        # Only the common prefix (the system prompt and the "<user>Question " the dropped turn began with).
        assert first.position_shift == 0 and first.reused_tokens < len(ids) // 3
        assert first_next.reused_tokens >= len(ids) and engine.stats().shifted_turns == 0
    finally:
        engine.close()
