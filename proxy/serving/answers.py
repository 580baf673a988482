"""The answer writer: an engine's events as the client's answer, in the shape of the API it called,
streamed (SSE) or as one JSON body. Written once for every engine.

`write_answer` drives it: the headers go out with the first token (the turn's TTFT and hit level are in
them), text streams as it comes, `on_finish` runs before the client sees the end (so its next turn
finds the session indexed), and an error after the headers went out is reported in-band, as OpenAI
does mid-stream. Each API's `AnswerFormat` only says what bytes each moment is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson
from aiohttp import web

from local_runner.jobs import Event, Failed, Finished, TextDelta

from ..errors import APIError, error_body
from ..openai import chat as chat_wire
from ..openai import completions as completion_wire
from ..openai import responses as responses_wire

OnFinish = Callable[[Finished, str], Awaitable[None]]


def sse_error(message: str, code: str = "server_error") -> bytes:
    """The one mid-stream error event of Chat Completions and Completions streams (OpenAI's shape)."""
    return b"data: " + error_body(message, code) + b"\n\n"


class AnswerFormat(Protocol):
    stream: bool

    def opening(self) -> bytes:
        """A stream's first events, before any text."""
        ...

    def delta(self, text: str) -> bytes: ...

    def closing(self, done: Finished, text: str) -> bytes:
        """A stream's last events (the finish, the usage, [DONE] where the API has one)."""
        ...

    def failure(self, message: str, text: str) -> bytes:
        """A stream's in-band error after the headers went out."""
        ...

    def body(self, done: Finished, text: str) -> dict[str, Any]:
        """The whole answer, not streamed."""
        ...


def _finish_reason(done: Finished) -> str:
    return "length" if done.finish_reason == "length" else "stop"


class ChatFormat:
    def __init__(self, model: str, fingerprint: str, *, stream: bool, include_usage: bool) -> None:
        self.ids = chat_wire.CompletionIds(model=model, system_fingerprint=fingerprint)
        self.stream, self.include_usage = stream, include_usage

    def opening(self) -> bytes:
        first = {"role": "assistant", "content": "", "refusal": None}
        return chat_wire.chunk(self.ids, first, include_usage=self.include_usage)

    def delta(self, text: str) -> bytes:
        return chat_wire.chunk(self.ids, {"content": text}, include_usage=self.include_usage)

    def closing(self, done: Finished, text: str) -> bytes:
        out = chat_wire.chunk(self.ids, {}, _finish_reason(done), include_usage=self.include_usage)
        if self.include_usage:
            out += chat_wire.chunk(self.ids, None, include_usage=True, usage_=_chat_usage(done))
        return out + chat_wire.DONE

    def failure(self, message: str, text: str) -> bytes:
        return sse_error(message)

    def body(self, done: Finished, text: str) -> dict[str, Any]:
        return chat_wire.completion(self.ids, text, _finish_reason(done), _chat_usage(done))


def _chat_usage(done: Finished) -> dict[str, Any]:
    return chat_wire.usage(done.prompt_tokens, done.completion_tokens, done.reused_tokens)


class CompletionFormat:
    def __init__(self, model: str, fingerprint: str, *, stream: bool, include_usage: bool) -> None:
        self.ids = completion_wire.TextCompletionIds(model=model, system_fingerprint=fingerprint)
        self.stream, self.include_usage = stream, include_usage

    def opening(self) -> bytes:
        return b""

    def delta(self, text: str) -> bytes:
        return completion_wire.chunk(self.ids, text, include_usage=self.include_usage)

    def closing(self, done: Finished, text: str) -> bytes:
        out = completion_wire.chunk(self.ids, "", _finish_reason(done), include_usage=self.include_usage)
        if self.include_usage:
            out += completion_wire.chunk(self.ids, None, include_usage=True, usage=_chat_usage(done))
        return out + chat_wire.DONE

    def failure(self, message: str, text: str) -> bytes:
        return sse_error(message)

    def body(self, done: Finished, text: str) -> dict[str, Any]:
        return completion_wire.completion(self.ids, text, _finish_reason(done), _chat_usage(done))


class ResponsesFormat:
    """The Responses API: one output message with one output_text part."""

    def __init__(self, shape: responses_wire.ResponseShape, *, stream: bool) -> None:
        self.shape, self.stream = shape, stream

    def opening(self) -> bytes:
        s = self.shape
        started = s.response("in_progress", [])
        item = s.message("", "in_progress")
        return (
            s.event("response.created", response=started)
            + s.event("response.in_progress", response=started)
            + s.event("response.output_item.added", output_index=0, item=item)
            + s.event(
                "response.content_part.added",
                item_id=s.item_id,
                output_index=0,
                content_index=0,
                part=responses_wire.output_text(""),
            )
        )

    def delta(self, text: str) -> bytes:
        return self.shape.event(
            "response.output_text.delta",
            item_id=self.shape.item_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def closing(self, done: Finished, text: str) -> bytes:
        s = self.shape
        final = self.body(done, text)
        item = final["output"][0]
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return (
            s.event(
                "response.output_text.done",
                item_id=s.item_id,
                output_index=0,
                content_index=0,
                text=text,
                logprobs=[],
            )
            + s.event(
                "response.content_part.done",
                item_id=s.item_id,
                output_index=0,
                content_index=0,
                part=responses_wire.output_text(text),
            )
            + s.event("response.output_item.done", output_index=0, item=item)
            + s.event(kind, response=final)
        )

    def failure(self, message: str, text: str) -> bytes:
        s = self.shape
        failed = s.response("failed", [], error={"code": "server_error", "message": message})
        return s.event("response.failed", response=failed)

    def body(self, done: Finished, text: str) -> dict[str, Any]:
        incomplete = done.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        usage = responses_wire.usage(done.prompt_tokens, done.completion_tokens, done.reused_tokens)
        return self.shape.response(
            status,
            [self.shape.message(text, status)],
            usage,
            incomplete="max_output_tokens" if incomplete else None,
        )


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


async def write_answer(
    request: web.Request,
    answer: AnswerFormat,
    headers: dict[str, str],
    events: AsyncIterator[Event],
    on_finish: OnFinish,
) -> web.StreamResponse:
    """The client's answer from the turn's events after its first token (see the module docstring)."""
    stream: web.StreamResponse | None = None
    if answer.stream:
        stream = web.StreamResponse(headers={**headers, "Cache-Control": "no-cache"})
        stream.content_type = "text/event-stream"
        await stream.prepare(request)
        opening = answer.opening()
        if opening:
            await stream.write(opening)
    parts: list[str] = []
    async for event in events:
        if isinstance(event, TextDelta):
            parts.append(event.text)
            if stream is not None:
                await stream.write(answer.delta(event.text))
        elif isinstance(event, Finished):
            text = "".join(parts)
            await on_finish(event, text)
            if stream is None:
                return web.json_response(answer.body(event, text), headers=headers, dumps=_dumps)
            await stream.write(answer.closing(event, text))
            await stream.write_eof()
            return stream
        elif isinstance(event, Failed):
            if stream is None:
                raise APIError(
                    event.status if event.status >= 500 else 500, event.message, type_="server_error"
                )
            await stream.write(answer.failure(event.message, "".join(parts)))
            await stream.write_eof()
            return stream
    raise AssertionError("the engine's events ended without Finished or Failed")
