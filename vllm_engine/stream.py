"""vLLM's streamed /v1/completions answer, read as stream items: text deltas, the finish, the usage.

The backend always asks vLLM for a stream (with the usage at its end), whether or not its client
streams: the first chunk is the first token, which is when the turn's headers (its TTFT and what it
reused) can be made.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from aiohttp import ClientResponse

from engine_api.sampling import TokenLogprob


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: list[TokenLogprob] | None = None  # when the request asked for them (token ids as ids)


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" or "length"
    stop_sequence: str | None = None  # the stop string that ended it (vLLM's `stop_reason`, when a string)


@dataclass(frozen=True)
class TokenUsage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class StreamError:
    message: str


StreamItem = Delta | Finish | TokenUsage | StreamError


def parse_event(line: bytes) -> list[StreamItem]:
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
    events: list[StreamItem] = []
    for choice in body.get("choices") or ():
        logprobs = _logprobs(choice.get("logprobs"))
        if choice.get("text") or logprobs:
            events.append(Delta(choice.get("text") or "", logprobs))
        if choice.get("finish_reason"):
            matched = choice.get("stop_reason")
            events.append(
                Finish(
                    "length" if choice["finish_reason"] == "length" else "stop",
                    matched if isinstance(matched, str) else None,  # an int: a stop token id
                )
            )
    usage = body.get("usage")
    if usage:
        events.append(TokenUsage(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))))
    return events


def _token_id(token: str) -> int:
    """A token as vLLM names it with `return_tokens_as_token_ids` ("token_id:123")."""
    return int(token.rpartition(":")[2])


def _logprobs(doc: object) -> list[TokenLogprob] | None:
    """A completion chunk's logprobs (tokens, token_logprobs, top_logprobs) as the engine's own, each
    token's alternatives most likely first."""
    if not isinstance(doc, dict) or not doc.get("tokens"):
        return None
    out = []
    tops = doc.get("top_logprobs") or [None] * len(doc["tokens"])
    for token, logprob, top in zip(doc["tokens"], doc["token_logprobs"], tops, strict=True):
        ranked = sorted(((_token_id(t), float(v)) for t, v in (top or {}).items()), key=lambda tv: -tv[1])
        out.append(TokenLogprob(_token_id(token), float(logprob), tuple(ranked)))
    return out


async def completion_events(response: ClientResponse) -> AsyncIterator[StreamItem]:
    async for line in response.content:
        for event in parse_event(line):
            yield event
