"""Batched steps through the real worker on a tiny random Llama: a job's answer does not depend on the
company it keeps (joining late, reusing stored KV, cancelled neighbours, stops, EOS, a failing job)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import torch

from engine_api.sampling import SamplingParams
from engine_api.turn import Failed, Finished, FirstToken, GenerationRequest, TextDelta
from kvtier import KVStore, StoreConfig
from local_runner.engine import EmbeddedEngine
from local_runner.job_kv import JobKV
from local_runner.jobs import Job
from local_runner.step import Work, run_per_job
from proxy.local.config import engine_config
from tests.tiny_model import tiny_llama, tiny_loaded

PROMPTS = [
    "hi",
    "tell me a story about a cat",
    "abc",
    "What is two plus two?",
    "x" * 40,
    "Count: 1 2 3 4 5 6 7 8 9",
    "ok",
    "The quick brown fox jumps over the lazy dog.",
]


@dataclass
class Outcome:
    text: str = ""
    first: FirstToken | None = None
    end: Finished | Failed | None = None
    deltas: int = 0
    events: list = field(default_factory=list)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=7)


@pytest.fixture(scope="module")
def lm(model):
    return tiny_loaded("tiny", model=model)


def greedy_alone(lm, prompt_ids: list[int], n: int) -> list[int]:
    """Reference: the job alone, one plain transformers forward per token, no store."""
    kv = JobKV.standalone(lm.layout, lm.device, len(prompt_ids) + n)
    logits = run_per_job(lm, [Work(kv, list(prompt_ids), want_logits=True)])[0].tensor
    out: list[int] = []
    for _ in range(n):
        token = int(torch.argmax(logits))
        if token in lm.eos_token_ids:
            break
        out.append(token)
        logits = run_per_job(lm, [Work(kv, [token], want_logits=True)])[0].tensor
    return out


def ids_of(lm, text: str) -> list[int]:
    return lm.tokenizer.encode(text, add_special_tokens=False)


async def drain(job: Job, on_delta=None) -> Outcome:
    out = Outcome()
    async for event in job.events():
        out.events.append(event)
        if isinstance(event, FirstToken):
            out.first = event
        elif isinstance(event, TextDelta):
            out.text += event.text
            out.deltas += 1
            if on_delta is not None:
                on_delta(out)
        else:
            out.end = event
    return out


def submit(engine: EmbeddedEngine, model: str, ids: list[int], max_tokens: int, **kw) -> Job:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, stop=kw.pop("stop", []))
    return engine.submit(GenerationRequest(model, ids, sampling, **kw))


async def test_eight_jobs_joining_at_different_steps_equal_each_alone(lm, model, tmp_path):
    eos_lm = tiny_loaded("tiny-eos", model=model)  # same weights, another end-of-sequence token
    store = KVStore(
        StoreConfig(
            l0_capacity_bytes=1 << 20,
            l1_capacity_bytes=1 << 20,
            l2_capacity_bytes=1 << 24,
            l2_path=tmp_path / "kv",
            chunk_tokens=16,
            device=torch.device("cpu"),
        ),
        lm.layout,
        lm.fingerprint,
    )
    n = 24
    prompts = [ids_of(lm, p) for p in PROMPTS]
    expected = [greedy_alone(lm, p, n) for p in prompts]

    engine = EmbeddedEngine(
        {"tiny": lm, "tiny-eos": eos_lm}, {"tiny": store}, config=engine_config(max_running=8, max_queue=8)
    ).start()
    try:
        # Turn 1 of two conversations, alone: their KV is stored for the reuse below.
        for i in (1, 5):
            done = await drain(submit(engine, "tiny", prompts[i], n))
            assert done.end is not None and isinstance(done.end, Finished)
        store.flush()
        # Turn 2 of those conversations: the stored prompt + answer + a new question.
        turn2 = [prompts[i] + expected[i] + ids_of(lm, " and then?") for i in (1, 5)]
        expected2 = [greedy_alone(lm, p, n) for p in turn2]

        stop_at = lm.tokenizer.decode(expected[3][4:6])
        eos_token = expected[2][5]
        eos_lm.eos_token_ids = frozenset({eos_token})
        early = [
            submit(engine, "tiny", prompts[0], n),
            submit(engine, "tiny", prompts[3], n, stop=[stop_at]),
            submit(engine, "tiny-eos", prompts[2], n),
            submit(engine, "tiny", prompts[4], 200),  # cancelled mid-way
        ]
        late_ready = asyncio.Event()
        late_submitted = asyncio.Event()

        def after_three(out: Outcome) -> None:
            if out.deltas >= 3:
                late_ready.set()

        def cancel_once_others_joined(out: Outcome) -> None:
            if late_submitted.is_set() and out.deltas >= 5:
                early[3].cancel()

        drains = [
            asyncio.ensure_future(drain(early[0], after_three)),
            asyncio.ensure_future(drain(early[1])),
            asyncio.ensure_future(drain(early[2])),
            asyncio.ensure_future(drain(early[3], cancel_once_others_joined)),
        ]
        await late_ready.wait()  # the others join while these are decoding
        late = [
            submit(engine, "tiny", turn2[0], n),
            submit(engine, "tiny", turn2[1], n),
            submit(engine, "tiny", prompts[6], n),
            submit(engine, "tiny", prompts[7], n),
        ]
        late_submitted.set()
        drains += [asyncio.ensure_future(drain(j)) for j in late]
        results = await asyncio.gather(*drains)
    finally:
        engine.close()

    def text(ids: list[int]) -> str:
        return lm.tokenizer.decode(ids, skip_special_tokens=True)

    plain, stopped, eos_end, cancelled, reuse_a, reuse_b, late_a, late_b = results
    assert plain.text == text(expected[0]) and plain.end.completion_tokens == len(expected[0])
    full3 = text(expected[3])
    assert stopped.end.finish_reason == "stop" and stopped.text == full3[: full3.index(stop_at)]
    k = expected[2].index(eos_token)
    assert eos_end.end.finish_reason == "stop" and eos_end.end.completion_tokens == k
    assert eos_end.text == text(expected[2][:k])
    assert isinstance(cancelled.end, Finished) and cancelled.end.finish_reason == "cancelled"
    assert cancelled.end.completion_tokens < 200
    for got, want in ((reuse_a, expected2[0]), (reuse_b, expected2[1])):
        assert got.first is not None and got.first.reused_tokens > 0
        assert got.text == text(want)
    assert late_a.text == text(expected[6]) and late_b.text == text(expected[7])


async def test_a_failing_job_fails_alone(lm):
    engine = EmbeddedEngine({"tiny": lm}, config=engine_config(max_running=4)).start()
    try:
        good = ids_of(lm, "hello there")
        bad = [lm.model.config.vocab_size + 5] * 3  # no such token: its embedding lookup raises
        jobs = [
            submit(engine, "tiny", good, 8),
            submit(engine, "tiny", bad, 8),
            submit(engine, "tiny", good, 8),
        ]
        a, b, c = await asyncio.gather(*(drain(j) for j in jobs))
    finally:
        engine.close()
    want = lm.tokenizer.decode(greedy_alone(lm, good, 8), skip_special_tokens=True)
    assert isinstance(b.end, Failed)
    assert a.text == want and c.text == want


async def test_a_job_that_does_not_fit_the_kv_budget_waits(lm):
    ids = ids_of(lm, "a prompt of some length")
    per_job = (len(ids) + 16) * lm.layout.bytes_per_token
    engine = EmbeddedEngine(
        {"tiny": lm}, config=engine_config(max_running=4, kv_budget_bytes=int(per_job * 1.5))
    ).start()
    try:
        first, second = submit(engine, "tiny", ids, 16), submit(engine, "tiny", ids, 16)
        done_when_second_started: list[bool] = []

        async def watch(job: Job) -> None:
            async for event in job.events():
                if isinstance(event, FirstToken):
                    done_when_second_started.append(first.done)

        await asyncio.gather(drain(first), watch(second))
    finally:
        engine.close()
    assert done_when_second_started == [True]


async def test_cancelling_frees_the_slot_for_a_queued_job(lm):
    engine = EmbeddedEngine({"tiny": lm}, config=engine_config(max_running=1, max_queue=2)).start()
    try:
        long = submit(engine, "tiny", ids_of(lm, "go on"), 400)
        events = long.events()
        assert isinstance(await anext(events), FirstToken)
        waiting = submit(engine, "tiny", ids_of(lm, "short"), 4)
        long.cancel()
        rest = [e async for e in events]
        done = await drain(waiting)
    finally:
        engine.close()
    assert isinstance(rest[-1], Finished) and rest[-1].finish_reason == "cancelled"
    assert isinstance(done.end, Finished) and done.end.finish_reason in ("length", "stop")


async def test_jobs_preempted_when_the_pool_runs_out_still_answer_as_alone(lm, monkeypatch):
    """A pool of 8 pages of 16 tokens for three jobs that each grow to 4 pages: when a decoding job finds
    no free page, the youngest other job gives its pages back and waits; run again, it feeds its prompt
    and its answer so far, then decodes on. Every answer equals the job's alone, token for token."""
    from local_runner import model_step
    from local_runner.kv_pages import PagePool

    monkeypatch.setattr(
        model_step,
        "_make_pool",
        lambda lm, jobs, context, page_tokens, reserve: PagePool(lm.layout, lm.device, 8, 16),
    )
    prompts = [ids_of(lm, PROMPTS[i] * 2)[:20] for i in (1, 3, 7)]
    n = 40
    expected = [greedy_alone(lm, p, n) for p in prompts]
    assert sum(len(p) + len(e) for p, e in zip(prompts, expected, strict=True)) > 8 * 16  # more than the pool
    engine = EmbeddedEngine({"tiny": lm}, config=engine_config(max_running=3, max_queue=4)).start()
    try:
        results = await asyncio.gather(*(drain(submit(engine, "tiny", p, n)) for p in prompts))
        preempted = engine.scheduler.preemptions
    finally:
        engine.close()
    assert preempted >= 1  # the pool did run out
    for got, want, prompt in zip(results, expected, prompts, strict=True):
        assert isinstance(got.end, Finished) and got.end.completion_tokens == len(want)
        assert got.text == lm.tokenizer.decode(want, skip_special_tokens=True)
        assert got.end.prompt_tokens == len(prompt)
