"""batch_invariant (issue 17): with the real model, 8 greedy answers served 8 at once equal the same
requests served one at a time, token for token, in float32 and in bfloat16."""

from __future__ import annotations

import asyncio

import pytest
import torch

from local_runner.jobs import GenerationRequest
from local_runner.loader import load_model
from local_runner.params import SamplingParams
from local_runner.runner import Runner, RunnerConfig
from proxy.settings import DEFAULT_MODEL_SOURCE
from tests.model_fixture import MODEL, REPO
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


async def alone_and_together(lm, *, batch_invariant: bool) -> tuple[list[str], list[str]]:
    """The 8 questions' greedy answers served one at a time, then all 8 at once, by a runner of 8 slots."""
    runner = Runner(
        {MODEL: lm}, config=RunnerConfig(max_running=8, max_queue=8, batch_invariant=batch_invariant)
    )

    def submit(ids: list[int]):
        return runner.submit(GenerationRequest(MODEL, ids, SamplingParams(max_tokens=TOKENS, temperature=0)))

    try:
        prompts = [runner.render(MODEL, [{"role": "user", "content": q}]) for q in QUESTIONS]
        alone = [(await drain(submit(p))).text for p in prompts]
        together = [o.text for o in await asyncio.gather(*(drain(submit(p)) for p in prompts))]
    finally:
        runner.close()
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


async def test_in_float32_the_default_engine_answers_as_alone(smollm):
    """The contract's float32 promise holds without batch_invariant: the batched decode attention and
    the row-count-dependent products change float32 results only far below what moves a greedy token."""
    assert smollm.dtype == torch.float32 and smollm.rows_invariant is None  # the default engine's model
    alone, together = await alone_and_together(smollm, batch_invariant=False)
    assert together == alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_with_batch_invariant_stored_kv_equals_a_recompute_bit_for_bit(models, dtype):
    """Reuse is exact in every dtype with batch_invariant: KV computed as a turn is (a prompt chunk, then
    the answer a token at a time) equals KV computed as a recompute (one chunk), and so do the logits."""
    from local_runner.decoder import DecoderStack
    from local_runner.job_kv import JobKV
    from local_runner.model_step import ModelStep
    from local_runner.step import Work, run_packed

    lm = models[dtype]
    ModelStep.prepare(lm, slots=1, context=64, batch=True, batch_invariant=True).pool.close()
    stack = DecoderStack(lm.model)
    ids = lm.tokenizer(" ".join(QUESTIONS))["input_ids"][:40]
    recompute, turn = (JobKV.standalone(lm.layout, lm.device, 64) for _ in range(2))
    whole = run_packed(lm, [Work(recompute, ids, True)], stack=stack, batch_invariant=True)[0]
    run_packed(lm, [Work(turn, ids[:12], False)], stack=stack, batch_invariant=True)
    for token in ids[12:]:
        last = run_packed(lm, [Work(turn, [token], True)], stack=stack, batch_invariant=True)[0]
    assert torch.equal(whole, last)
    for (ka, va), (kb, vb) in zip(recompute.layers(), turn.layers(), strict=True):
        assert torch.equal(ka[..., :40, :], kb[..., :40, :]) and torch.equal(va[..., :40, :], vb[..., :40, :])
