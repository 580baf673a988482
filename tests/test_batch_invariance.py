"""batch_invariant, the default (issues 17, 29): with the real model, 8 greedy answers served 8 at once
equal the same requests served one at a time, token for token, in float32 and in bfloat16; KV computed in
prompt chunks of any size, or a token at a time, is bit for bit the same."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine_api.sampling import SamplingParams
from engine_api.turn import GenerationRequest
from local_runner.engine import EmbeddedEngine
from local_runner.loader import load_model
from proxy.local.config import engine_config
from proxy.settings import DEFAULT_MODEL_SOURCE
from tests.model_fixture import MODEL, REPO
from tests.rendering import render
from tests.test_local_runner_batching import drain

pytestmark = pytest.mark.model

QUESTIONS = [
    "Name three rivers in Europe.",
    "What is the capital of Japan?",
    "Write a haiku about autumn.",
    "Explain what a cache is, in one sentence.",
    "List the first five prime numbers.",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
]
TOKENS = 12


async def alone_and_together(lm, *, batch_invariant: bool | None) -> tuple[list[str], list[str]]:
    """The 8 questions' greedy answers served one at a time, then all 8 at once, by a engine of 8 slots."""
    engine = EmbeddedEngine(
        {MODEL: lm}, config=engine_config(max_running=8, max_queue=8, batch_invariant=batch_invariant)
    ).start()

    def submit(ids: list[int]):
        return engine.submit(GenerationRequest(MODEL, ids, SamplingParams(max_tokens=TOKENS, temperature=0)))

    try:
        prompts = [render(engine, MODEL, [{"role": "user", "content": q}]).ids for q in QUESTIONS]
        alone = [(await drain(submit(p))).text for p in prompts]
        together = [o.text for o in await asyncio.gather(*(drain(submit(p)) for p in prompts))]
    finally:
        engine.close()
    return alone, together


@pytest.fixture(scope="module")
def models():
    """Models of their own: batch_invariant wraps the linear layers of the model it runs (the session's
    shared model stays as the other tests know it)."""
    load = {"device": "cpu", "cache_dir": REPO / "var" / "models"}
    return {
        dtype: load_model(MODEL, DEFAULT_MODEL_SOURCE, dtype=dtype, **load)
        for dtype in ("float32", "bfloat16")
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_eight_answers_served_together_equal_each_served_alone(models, dtype):
    lm = models[dtype]
    alone, together = await alone_and_together(lm, batch_invariant=True)
    assert lm.rows_invariant  # every linear layer was measured to compute each row alone
    assert together == alone
    assert len(set(alone)) > 1  # real, different answers


async def test_the_default_engine_answers_as_alone(smollm):
    """The default EngineConfig is batch-invariant on a CPU ("auto"): the session's shared model (float32
    here) served 8 at once answers as alone, its linear layers measured row-invariant."""
    from local_runner.model_step import invariant_by_default

    assert engine_config().batch_invariant is None and invariant_by_default(torch.device("cpu"))
    alone, together = await alone_and_together(smollm, batch_invariant=engine_config().batch_invariant)
    assert smollm.rows_invariant
    assert together == alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_prefilled_in_chunks_of_any_size_gives_bit_identical_kv(models, dtype):
    """A 600-token prompt prefilled in chunks of 64, 256 and 512 tokens, beside a decoding job, gives the
    same KV bit for bit and the same last logits (the scheduler's chunk size never changes an answer)."""
    from local_runner.decoder import DecoderStack
    from local_runner.job_kv import JobKV
    from local_runner.model_step import ModelStep
    from local_runner.step import Work, run_packed

    lm = models[dtype]
    rows = engine_config().max_step_rows  # what an engine at the default settings measures up to
    ModelStep.prepare(
        lm, slots=1, context=64, batch=True, batch_invariant=True, compile=False, max_rows=rows
    ).pool.close()
    stack = DecoderStack(lm.model)
    ids = (lm.tokenizer(" ".join(QUESTIONS * 12))["input_ids"] * 2)[:600]
    results = []
    for chunk in (64, 256, 512):
        kv, other = JobKV.standalone(lm.layout, lm.device, 640), JobKV.standalone(lm.layout, lm.device, 640)
        run_packed(lm, [Work(other, ids[: chunk // 2], False)], stack=stack, batch_invariant=True)
        for first in range(0, len(ids), chunk):
            part = ids[first : first + chunk]
            work = [Work(kv, part, first + chunk >= len(ids)), Work(other, [ids[first % 100]], True)]
            logits = run_packed(lm, work, stack=stack, batch_invariant=True)[0]
        assert logits is not None
        results.append(
            (logits.tensor, [(k[..., :600, :].clone(), v[..., :600, :].clone()) for k, v in kv.layers()])
        )
    for logits, layers in results[1:]:
        assert torch.equal(logits, results[0][0])
        for (ka, va), (kb, vb) in zip(layers, results[0][1], strict=True):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_with_batch_invariant_stored_kv_equals_a_recompute_bit_for_bit(models, dtype):
    """Reuse is exact in every dtype with batch_invariant: KV computed as a turn is (a prompt chunk, then
    the answer a token at a time) equals KV computed as a recompute (one chunk), and so do the logits."""
    from local_runner.decoder import DecoderStack
    from local_runner.job_kv import JobKV
    from local_runner.model_step import ModelStep
    from local_runner.step import Work, run_packed

    lm = models[dtype]
    rows = engine_config().max_step_rows  # what an engine at the default settings measures up to
    ModelStep.prepare(
        lm, slots=1, context=64, batch=True, batch_invariant=True, compile=False, max_rows=rows
    ).pool.close()
    stack = DecoderStack(lm.model)
    ids = lm.tokenizer(" ".join(QUESTIONS))["input_ids"][:40]
    recompute, turn = (JobKV.standalone(lm.layout, lm.device, 64) for _ in range(2))
    whole = run_packed(lm, [Work(recompute, ids, True)], stack=stack, batch_invariant=True)[0].tensor
    run_packed(lm, [Work(turn, ids[:12], False)], stack=stack, batch_invariant=True)
    for token in ids[12:]:
        last = run_packed(lm, [Work(turn, [token], True)], stack=stack, batch_invariant=True)[0].tensor
    assert torch.equal(whole, last)
    for (ka, va), (kb, vb) in zip(recompute.layers(), turn.layers(), strict=True):
        assert torch.equal(ka[..., :40, :], kb[..., :40, :]) and torch.equal(va[..., :40, :], vb[..., :40, :])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_every_turn_from_stored_kv_equals_a_recompute_through_the_tiers(models, dtype, tmp_path):
    """Three conversations of 3, 8 and 8 turns taken in turn at the default settings, with an L0 and an
    L1 of one chunk each, so a conversation's history comes back from L0, L1 or L2 (the others' turns
    push it down): every later turn's greedy answer from stored KV equals a recompute of the same prompt
    (reuse off), in float32 and bfloat16."""
    from kvtier import KVStore, StoreConfig

    lm = models[dtype]
    chunk = 256 * lm.layout.bytes_per_token
    store = KVStore(
        StoreConfig(
            l0_capacity_bytes=chunk, l1_capacity_bytes=chunk, l2_capacity_bytes=1 << 30, l2_path=tmp_path
        ),
        lm.layout,
        lm.fingerprint,
    )
    engine = EmbeddedEngine(
        {MODEL: lm}, {MODEL: store}, config=engine_config(max_running=4, max_queue=8)
    ).start()
    assert engine.steps[MODEL].batch_invariant  # the default

    def submit(ids: list[int], **kw):
        sampling = SamplingParams(max_tokens=TOKENS, temperature=0)
        return engine.submit(GenerationRequest(MODEL, ids, sampling, **kw))

    turns = {"short": 3, "long": 8, "other": 8}
    histories: dict[str, list[dict[str, str]]] = {name: [] for name in turns}
    tiers: set[str] = set()
    try:
        for turn in range(max(turns.values())):
            for session, count in turns.items():
                if turn >= count:
                    continue
                history = histories[session]
                history.append({"role": "user", "content": QUESTIONS[(turn + len(session)) % len(QUESTIONS)]})
                ids = render(engine, MODEL, history).ids
                reused = await drain(submit(ids, session=session))
                if turn:
                    assert reused.first.reused_tokens > 0, (session, turn)
                    tiers.add(str(reused.first.tier))
                    recomputed = await drain(submit(ids, reuse=False))
                    assert reused.text == recomputed.text, (dtype, session, turn)
                history.append({"role": "assistant", "content": reused.text})
                await asyncio.sleep(0.2)  # the turn's KV is saved in the background
    finally:
        engine.close()
    assert {"l1", "l2"} <= tiers, tiers  # the small fast tiers sent histories down the hierarchy
