"""vLLM's streamed /v1/completions answer, read as events: text deltas, the finish, the usage.

The backend always asks vLLM for a stream (with the usage at its end), whether or not its client
streams: the first chunk is the first token, which is when the turn's headers (its TTFT and what it
reused) can be made.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from aiohttp import ClientResponse


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" or "length"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class StreamError:
    message: str


Event = Delta | Finish | Usage | StreamError


def parse_event(line: bytes) -> list[Event]:
    """The events of one SSE line (`data: {...}`); nothing for blank lines, comments and [DONE]."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return []
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return []
    body = orjson.loads(payload)
    if "error" in body:
        error = body["error"]
        return [StreamError(str(error.get("message") if isinstance(error, dict) else error))]
    events: list[Event] = []
    for choice in body.get("choices") or ():
        if choice.get("text"):
            events.append(Delta(choice["text"]))
        if choice.get("finish_reason"):
            events.append(Finish("length" if choice["finish_reason"] == "length" else "stop"))
    usage = body.get("usage")
    if usage:
        events.append(Usage(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))))
    return events


async def completion_events(response: ClientResponse) -> AsyncIterator[Event]:
    async for line in response.content:
        for event in parse_event(line):
            yield event
