"""Fair admission in the engine (issue 18), on a tiny random Llama: a client alone may use everything,
clients alternate, the queue is bounded for hits and misses alike, a client past its share is refused
(429) only while others need the room, and a cancelled waiting job leaves the queue at once."""

from __future__ import annotations

import asyncio

import pytest

from engine_api.errors import OverShare, QueueFull
from engine_api.sampling import SamplingParams
from engine_api.turn import Failed, Finished, FirstToken, GenerationRequest
from local_runner.engine import EmbeddedEngine
from local_runner.jobs import Job
from proxy.local.config import engine_config
from tests.test_local_runner_batching import drain, ids_of
from tests.tiny_model import tiny_llama, tiny_loaded


@pytest.fixture(scope="module")
def lm():
    return tiny_loaded(model=tiny_llama(seed=21))


def request(lm, client: str, text: str, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(
        "tiny", ids_of(lm, text), SamplingParams(max_tokens=max_tokens, temperature=0), client=client
    )


async def first_event(job: Job):
    return await anext(job.events())


async def test_one_client_alone_may_use_every_slot_and_the_whole_queue(lm):
    engine = EmbeddedEngine({"tiny": lm}, config=engine_config(max_running=4, max_queue=16)).start()
    try:
        jobs = [engine.submit(request(lm, "a", f"conversation {i}")) for i in range(12)]
        outs = await asyncio.gather(*(drain(j) for j in jobs))
    finally:
        engine.close()
    assert all(isinstance(o.end, Finished) for o in outs)


async def test_the_queue_is_bounded_for_one_client(lm):
    """max_running 1 + max_queue 2: three accepted, the other seven refused as the queue is full (a
    client alone is never 'over its share': it gets 503, never 429)."""
    engine = EmbeddedEngine({"tiny": lm}, config=engine_config(max_running=1, max_queue=2)).start()
    accepted, refused = [], []
    try:
        for i in range(10):
            try:
                accepted.append(engine.submit(request(lm, "a", f"different {i}", max_tokens=30)))
            except QueueFull as exc:
                refused.append(exc)
        assert len(accepted) == 3 and len(refused) == 7
        outs = await asyncio.gather(*(drain(j) for j in accepted))
    finally:
        engine.close()
    assert all(isinstance(o.end, Finished) for o in outs)


async def test_clients_alternate_so_one_request_waits_at_most_one_admission(lm):
    """Client A keeps 12 requests waiting behind its running one; client B sends one: B is admitted
    right after A's next one (the order of first tokens with one slot is the order of admission)."""
    engine = EmbeddedEngine({"tiny": lm}, config=engine_config(max_running=1, max_queue=16)).start()
    try:
        a_jobs = [
            engine.submit(request(lm, "A", f"a{i}", max_tokens=400 if i == 0 else 12)) for i in range(13)
        ]
        await first_event(a_jobs[0])  # A's first runs (until cancelled below); twelve wait
        assert engine.scheduler.queue_depth() == 12
        b_job = engine.submit(request(lm, "B", "b only", max_tokens=12))
        a_jobs[0].cancel()
        order: list[str] = []

        async def watch(job: Job, name: str) -> None:
            async for event in job.events():
                if isinstance(event, FirstToken):
                    order.append(name)

        await asyncio.gather(*(watch(j, f"A{i}") for i, j in enumerate(a_jobs[1:], 1)), watch(b_job, "B"))
    finally:
        engine.close()
    assert order[:2] == ["A1", "B"], order


async def test_past_its_share_a_client_is_refused_only_while_others_need_the_room(lm):
    engine = EmbeddedEngine({"tiny": lm}, config=engine_config(max_running=1, max_queue=4)).start()
    try:
        a_jobs = [engine.submit(request(lm, "A", f"a{i}", max_tokens=400 if i == 0 else 8)) for i in range(5)]
        await first_event(a_jobs[0])  # runs until cancelled below: the queue stays full meanwhile
        with pytest.raises(QueueFull):  # alone and full: 503, not 429
            engine.submit(request(lm, "A", "a5"))
        # B arrives at a full queue: A holds 4 places, more than its share (4 // 2): A's newest gives
        # its place up with a 429, B's request is queued.
        b1 = engine.submit(request(lm, "B", "b1"))
        displaced = await first_event(a_jobs[4])
        assert isinstance(displaced, Failed) and displaced.status == 429 and displaced.retry_after_s
        b2 = engine.submit(request(lm, "B", "b2"))  # A still holds 3 > 2: once more
        displaced = await first_event(a_jobs[3])
        assert isinstance(displaced, Failed) and displaced.status == 429
        with pytest.raises(OverShare) as refused:  # B now holds its share while A waits
            engine.submit(request(lm, "B", "b3"))
        assert refused.value.retry_after_s >= 1
        a_jobs[0].cancel()
        outs = await asyncio.gather(*(drain(j) for j in (a_jobs[1], a_jobs[2], b1, b2)))
    finally:
        engine.close()
    assert all(isinstance(o.end, Finished) for o in outs)


async def test_a_cancelled_waiting_job_leaves_the_queue_and_the_window_at_once(lm):
    engine = EmbeddedEngine(
        {"tiny": lm}, config=engine_config(max_running=1, max_queue=4, lookahead=1)
    ).start()
    try:
        running = engine.submit(request(lm, "a", "long one", max_tokens=200))
        await first_event(running)
        head = engine.submit(request(lm, "b", "waiting head"))
        behind = engine.submit(request(lm, "c", "waiting behind"))
        assert engine.scheduler.window() == [head, behind] and engine.scheduler.queue_depth() == 2
        head.cancel()  # its client disconnected
        assert (
            engine.scheduler.window() == [behind] and engine.scheduler.queue_depth() == 1
        )  # the window moves on now
        running.cancel()
        out = await drain(behind)
    finally:
        engine.close()
    assert isinstance(out.end, Finished)
