"""The local engine on the real model, without HTTP: exact greedy output, stops, limits, scheduling."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine_api.errors import QueueFull
from engine_api.prompt import PromptError
from engine_api.sampling import SamplingParams
from engine_api.turn import Failed, Finished, FirstToken, GenerationRequest, TextDelta
from local_runner.engine import EmbeddedEngine
from proxy.local.config import engine_config
from tests.model_fixture import MODEL
from tests.rendering import render

pytestmark = pytest.mark.model

COLORS = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture
def engine(smollm):
    r = EmbeddedEngine({MODEL: smollm}, config=engine_config(max_queue=2, max_running=2)).start()
    yield r
    r.close()


async def run_job(engine: EmbeddedEngine, messages, **sampling):
    ids = render(engine, MODEL, messages).ids
    job = engine.submit(GenerationRequest(MODEL, ids, SamplingParams(**sampling)))
    text, first, end = [], None, None
    async for event in job.events():
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, FirstToken):
            first = event
        else:
            end = event
    return "".join(text), first, end, ids


async def test_greedy_output_equals_model_generate(engine, smollm):
    text, first, end, ids = await run_job(engine, COLORS, max_tokens=24, temperature=0)
    with torch.inference_mode():
        out = smollm.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    expected = smollm.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert text == expected
    assert first is not None and first.reused_tokens == 0 and first.tier is None
    assert isinstance(end, Finished) and end.prompt_tokens == len(ids)


async def test_max_tokens_ends_with_length(engine):
    text, _, end, _ = await run_job(engine, COLORS, max_tokens=3, temperature=0)
    assert end.finish_reason == "length" and end.completion_tokens == 3
    assert text


async def test_stop_string_across_tokens_is_cut_and_never_sent(engine):
    full, *_ = await run_job(engine, COLORS, max_tokens=24, temperature=0)
    # A stop string that spans a token boundary in the greedy answer ("\n2" is "\n" then "2").
    assert "\n2" in full
    text, _, end, _ = await run_job(engine, COLORS, max_tokens=24, temperature=0, stop=["\n2"])
    assert end.finish_reason == "stop"
    assert text == full[: full.index("\n2")]


async def test_seeded_sampling_is_reproducible(engine):
    a, *_ = await run_job(engine, COLORS, max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    b, *_ = await run_job(engine, COLORS, max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    assert a == b


async def test_two_jobs_interleave_token_by_token(engine):
    """A short answer finishes while a long one is still running: they share the worker by token."""
    long_ids = render(engine, MODEL, [{"role": "user", "content": "Write a long story about a dragon."}]).ids
    short_ids = render(engine, MODEL, COLORS).ids
    long_job = engine.submit(GenerationRequest(MODEL, long_ids, SamplingParams(max_tokens=60, temperature=0)))
    short_job = engine.submit(
        GenerationRequest(MODEL, short_ids, SamplingParams(max_tokens=4, temperature=0))
    )
    order: list[str] = []

    async def drain(job, name):
        async for event in job.events():
            if isinstance(event, TextDelta):
                order.append(name)
        order.append(f"{name}-end")

    await asyncio.gather(drain(long_job, "long"), drain(short_job, "short"))
    assert order.index("short-end") < order.index("long-end")
    assert "long" in order[: order.index("short-end")]  # the long one progressed meanwhile


async def test_cancel_stops_a_running_job(engine):
    ids = render(engine, MODEL, [{"role": "user", "content": "Count from one to one thousand."}]).ids
    job = engine.submit(GenerationRequest(MODEL, ids, SamplingParams(max_tokens=400, temperature=0)))
    events = job.events()
    assert isinstance(await anext(events), FirstToken)
    job.cancel()
    rest = [e async for e in events]
    assert isinstance(rest[-1], Finished) and rest[-1].finish_reason == "cancelled"
    assert rest[-1].completion_tokens < 400


async def test_queue_full_raises(smollm):
    engine = EmbeddedEngine({MODEL: smollm}, config=engine_config(max_queue=1, max_running=1)).start()
    try:
        ids = render(engine, MODEL, [{"role": "user", "content": "Count from one to one thousand."}]).ids
        jobs = [engine.submit(GenerationRequest(MODEL, ids, SamplingParams(max_tokens=400, temperature=0)))]
        assert isinstance(await anext(jobs[0].events()), FirstToken)  # the first one is running
        jobs.append(engine.submit(GenerationRequest(MODEL, ids, SamplingParams(max_tokens=5))))  # waits
        with pytest.raises(QueueFull):
            engine.submit(GenerationRequest(MODEL, ids, SamplingParams(max_tokens=5)))
        for job in jobs:  # one running, one waiting: both end as cancelled, neither as a failure
            job.cancel()
            events = [e async for e in job.events()]
            assert isinstance(events[-1], Finished) and events[-1].finish_reason == "cancelled"
            assert not any(isinstance(e, Failed) for e in events)
    finally:
        engine.close()


def test_unsupported_content_and_overlong_prompts_are_refused(engine):
    with pytest.raises(PromptError):
        render(
            engine, MODEL, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )
    with pytest.raises(PromptError, match="tokens"):
        render(engine, MODEL, [{"role": "user", "content": "word " * 9000}])


def test_overflowing_history_drops_oldest_turns_when_allowed(smollm):
    history = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        history += [
            {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"},
            {"role": "assistant", "content": f"The answer to question {i} is {2 * i}."},
        ]
    history.append({"role": "user", "content": "And the last question?"})
    strict = EmbeddedEngine(
        {MODEL: smollm}, config=engine_config(max_context_tokens=120, truncate_on_overflow=False)
    ).start()
    lenient = EmbeddedEngine(
        {MODEL: smollm}, config=engine_config(max_context_tokens=120, truncate_on_overflow=True)
    ).start()
    try:
        with pytest.raises(PromptError, match="tokens"):
            render(strict, MODEL, history, reserve=16)
        ids = render(lenient, MODEL, history, reserve=16).ids
        text = smollm.tokenizer.decode(ids)
        assert len(ids) + 16 <= 120
        assert "Be brief." in text and "And the last question?" in text
        assert "Question number 0" not in text and "Question number 5" in text
    finally:
        strict.close()
        lenient.close()


async def test_concurrent_jobs_answer_as_each_alone(smollm):
    """Four chats of different lengths share batched steps; each answer equals model.generate alone."""
    prompts = [
        "Name three colors.",
        "Write a haiku about the sea, then explain it in two sentences.",
        "What is 2+2?",
        "List the planets of the solar system in order from the sun.",
    ]
    engine = EmbeddedEngine({MODEL: smollm}, config=engine_config(max_running=4, max_queue=4)).start()
    try:
        results = await asyncio.gather(
            *(
                run_job(engine, [{"role": "user", "content": p}], max_tokens=16, temperature=0)
                for p in prompts
            )
        )
    finally:
        engine.close()
    for text, _, end, ids in results:
        with torch.inference_mode():
            out = smollm.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        assert text == smollm.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        assert isinstance(end, Finished)


async def test_rendering_from_many_threads_while_generating(engine):
    """The proxy renders prompts on executor threads while the worker decodes: no "Already borrowed"."""
    messages = [{"role": "user", "content": "Tell me about tokenizers and threads."}]
    expected = render(engine, MODEL, messages).ids
    job = asyncio.ensure_future(run_job(engine, COLORS, max_tokens=32, temperature=0))
    rendered = await asyncio.gather(*(asyncio.to_thread(render, engine, MODEL, messages) for _ in range(16)))
    text, _, end, _ = await job
    assert all(r.ids == expected for r in rendered)
    assert text and isinstance(end, Finished)
