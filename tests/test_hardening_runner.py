"""Issue 13: the local runner holds at most max_running + max_queue jobs in flight."""

from __future__ import annotations

import asyncio
import threading

import pytest

from local_runner.jobs import GenerationRequest, Job
from local_runner.params import SamplingParams
from local_runner.worker import QueueFull, Worker


def _job(loop: asyncio.AbstractEventLoop) -> Job:
    return Job(GenerationRequest(model="m", prompt_ids=[1, 2, 3], sampling=SamplingParams()), loop)


def test_submit_refuses_past_running_plus_queue_even_while_jobs_are_being_started():
    release = threading.Event()
    started = threading.Event()

    def slow_start(job: Job):
        started.set()
        release.wait(30)  # the loop has taken the job from the queue but not started it yet
        raise RuntimeError("not a real job")

    loop = asyncio.new_event_loop()
    worker = Worker(slow_start, lambda job: None, max_queue=2, max_running=1, lookahead=0)
    try:
        first = _job(loop)
        worker.submit(first)
        assert started.wait(10)
        accepted = [first]
        refused = 0
        for _ in range(10):
            job = _job(loop)
            try:
                worker.submit(job)
                accepted.append(job)
            except QueueFull:
                refused += 1
        assert len(accepted) == 3 and refused == 8  # max_running 1 + max_queue 2
        # A cancelled job (its client left) frees its place at once.
        accepted[-1].cancel()
        worker.submit(_job(loop))
        with pytest.raises(QueueFull):
            worker.submit(_job(loop))
    finally:
        release.set()
        worker.close()
        loop.close()
