"""n > 1: the n answers of one turn as one stream of (index, event).

The first answer runs as any turn does; once it has its first token (its prompt is in its slot) the
others start as forks of it (`GenerationRequest.fork_of`: the embedded engine copies the prompt's KV
from the first answer's slot instead of computing it again; another engine reuses what it can). An
answer the engine cannot take yet (its queue is full) starts when another answer ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable

from engine_api.errors import OverShare, QueueFull
from engine_api.turn import Event, Failed, Finished, GenerationRequest

Indexed = tuple[int, Event]
Run = Callable[[GenerationRequest], AsyncGenerator[Event, None]]


def sibling(gen: GenerationRequest, index: int) -> GenerationRequest:
    """Answer `index` of the same prompt: a fork of the first, its own seed when one was given (the n
    answers of a seeded request differ, and are each reproducible)."""
    seed = gen.sampling.seed
    sampling = dataclasses.replace(gen.sampling, seed=None if seed is None else seed + index)
    return dataclasses.replace(gen, sampling=sampling, fork_of=gen)


async def fan_out(
    first: Event, events: AsyncGenerator[Event, None], gen: GenerationRequest, n: int, run: Run
) -> AsyncGenerator[Indexed, None]:
    """Every answer's events, tagged with its index, until each has ended (Finished or Failed)."""
    yield 0, first
    if n == 1:
        async for event in events:
            yield 0, event
        return
    queue: asyncio.Queue[Indexed] = asyncio.Queue()
    ended = asyncio.Event()  # set whenever an answer ends: one the engine refused tries again then
    streaming = 1  # answers whose events are flowing (the first is)

    async def pump(index: int, stream: AsyncGenerator[Event, None]) -> None:
        nonlocal streaming
        try:
            async for event in stream:
                await queue.put((index, event))
        finally:
            streaming -= 1
            await stream.aclose()
            ended.set()

    async def start(index: int) -> None:
        nonlocal streaming
        while True:
            stream = run(sibling(gen, index))
            try:
                head = await anext(stream)
            except (QueueFull, OverShare) as exc:
                await stream.aclose()
                if not streaming:  # nothing will end and free a place
                    await queue.put((index, Failed(f"no room for answer {index}: {exc}", status=503)))
                    return
                ended.clear()
                await ended.wait()
                continue
            streaming += 1
            await queue.put((index, head))
            await pump(index, stream)
            return

    tasks = [asyncio.create_task(pump(0, events))]
    tasks += [asyncio.create_task(start(i)) for i in range(1, n)]
    try:
        open_answers = n
        if isinstance(first, Finished | Failed):
            open_answers -= 1
        while open_answers:
            index, event = await queue.get()
            yield index, event
            if isinstance(event, Finished | Failed):
                open_answers -= 1
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
