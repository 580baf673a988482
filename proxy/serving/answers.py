"""The answer writer: an engine's events as the client's answer, in the shape of the API it called,
streamed (SSE) or as one JSON body. Written once for every engine.

`write_answer` drives it: the headers go out with the first token (the turn's TTFT and hit level are in
them), text streams as it comes, `on_finish` runs before the client sees the end (so its next turn
finds the session indexed), and an error after the headers went out is reported in-band, as OpenAI
does mid-stream. Each API's format records the answer (`add`) and says what bytes each moment is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from local_runner.jobs import Event, Failed, Finished, TextDelta
from local_runner.params import TokenLogprob

from ..errors import APIError, error_body
from ..openai import chat as chat_wire
from ..openai import completions as completion_wire
from ..openai import responses as responses_wire
from .tools import ToolCall, ToolCallParser

OnFinish = Callable[[Finished], Awaitable[None]]
Decode = Callable[[int], str]  # a token id's text


def sse_error(message: str, code: str = "server_error") -> bytes:
    """The one mid-stream error event of Chat Completions and Completions streams (OpenAI's shape)."""
    return b"data: " + error_body(message, code) + b"\n\n"


def _finish_reason(done: Finished) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def _usage(done: Finished) -> dict[str, Any]:
    return chat_wire.usage(done.prompt_tokens, done.completion_tokens, done.reused_tokens)


class Answer:
    """The answer so far, and the bytes of each moment of its stream (the base writes no stream)."""

    def __init__(self, *, stream: bool) -> None:
        self.stream = stream
        self.parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def opening(self) -> bytes:
        return b""

    def add(self, delta: TextDelta) -> bytes:
        """Record a delta; the stream's bytes for it (b"" when nothing can go out yet)."""
        self.parts.append(delta.text)
        return b""

    def closing(self, done: Finished) -> bytes:
        raise NotImplementedError

    def failure(self, message: str) -> bytes:
        return sse_error(message)

    def body(self, done: Finished) -> dict[str, Any]:
        raise NotImplementedError


class ChatAnswer(Answer):
    """Chat Completions: content deltas, tool calls parsed out of the text (when the request has tools),
    log-probabilities per token (when asked)."""

    def __init__(
        self,
        model: str,
        fingerprint: str,
        *,
        stream: bool,
        include_usage: bool,
        tools: ToolCallParser | None = None,
        decode: Decode | None = None,
    ) -> None:
        super().__init__(stream=stream)
        self.ids = chat_wire.CompletionIds(model=model, system_fingerprint=fingerprint)
        self.include_usage = include_usage
        self.tools = tools
        self.decode = decode  # set when logprobs were asked for
        self.logprobs: list[dict[str, Any]] = []
        self._calls_sent = 0

    def _chunk(self, delta: dict[str, Any] | None, reason: str | None = None, **kw: Any) -> bytes:
        return chat_wire.chunk(self.ids, delta, reason, include_usage=self.include_usage, **kw)

    def opening(self) -> bytes:
        return self._chunk({"role": "assistant", "content": "", "refusal": None})

    def add(self, delta: TextDelta) -> bytes:
        super().add(delta)
        entries = self._logprob_entries(delta.logprobs)
        content = delta.text
        calls: tuple[ToolCall, ...] = ()
        if self.tools is not None:
            parsed = self.tools.feed(delta.text)
            content, calls = parsed.content, parsed.calls
        if not self.stream:
            return b""
        out = b""
        if content or entries:
            out += self._chunk({"content": content}, logprobs_=_logprobs_body(entries))
        for call in calls:
            out += self._chunk({"tool_calls": [call.to_openai(self._calls_sent)]})
            self._calls_sent += 1
        return out

    def _logprob_entries(self, logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
        if self.decode is None or not logprobs:
            return []
        entries = [_logprob_entry(lp, self.decode) for lp in logprobs]
        self.logprobs.extend(entries)
        return entries

    def _rest(self) -> tuple[str, list[ToolCall]]:
        """What the tool parser still held at the end: (content, calls)."""
        if self.tools is None:
            return "", []
        parsed = self.tools.finish()
        return parsed.content, list(parsed.calls)

    def _reason(self, done: Finished) -> str:
        if self.tools is not None and self.tools.calls:
            return "tool_calls"
        return _finish_reason(done)

    def closing(self, done: Finished) -> bytes:
        content, calls = self._rest()
        out = self._chunk({"content": content}) if content else b""
        for call in calls:
            out += self._chunk({"tool_calls": [call.to_openai(self._calls_sent)]})
            self._calls_sent += 1
        out += self._chunk({}, self._reason(done))
        if self.include_usage:
            out += chat_wire.chunk(self.ids, None, include_usage=True, usage_=_usage(done))
        return out + chat_wire.DONE

    def body(self, done: Finished) -> dict[str, Any]:
        self._rest()
        message: dict[str, Any] = {"role": "assistant", "content": self.text, "refusal": None}
        if self.tools is not None:
            content = "".join(self.tools.content)
            message["content"] = content if content or not self.tools.calls else None
            if self.tools.calls:
                message["tool_calls"] = [c.to_openai() for c in self.tools.calls]
        logprobs = _logprobs_body(self.logprobs) if self.decode is not None else None
        return chat_wire.completion(self.ids, message, self._reason(done), _usage(done), logprobs)


def _logprob_entry(lp: TokenLogprob, decode: Decode) -> dict[str, Any]:
    def one(token: int, logprob: float) -> dict[str, Any]:
        text = decode(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}


def _logprobs_body(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    return {"content": entries, "refusal": None} if entries else None


class CompletionAnswer(Answer):
    def __init__(self, model: str, fingerprint: str, *, stream: bool, include_usage: bool) -> None:
        super().__init__(stream=stream)
        self.ids = completion_wire.TextCompletionIds(model=model, system_fingerprint=fingerprint)
        self.include_usage = include_usage

    def add(self, delta: TextDelta) -> bytes:
        super().add(delta)
        if not (self.stream and delta.text):
            return b""
        return completion_wire.chunk(self.ids, delta.text, include_usage=self.include_usage)

    def closing(self, done: Finished) -> bytes:
        out = completion_wire.chunk(self.ids, "", _finish_reason(done), include_usage=self.include_usage)
        if self.include_usage:
            out += completion_wire.chunk(self.ids, None, include_usage=True, usage=_usage(done))
        return out + chat_wire.DONE

    def body(self, done: Finished) -> dict[str, Any]:
        return completion_wire.completion(self.ids, self.text, _finish_reason(done), _usage(done))


class ResponsesAnswer(Answer):
    """The Responses API: one output message with one output_text part."""

    def __init__(self, shape: responses_wire.ResponseShape, *, stream: bool) -> None:
        super().__init__(stream=stream)
        self.shape = shape

    def _part_event(self, kind: str, **fields: Any) -> bytes:
        return self.shape.event(kind, item_id=self.shape.item_id, output_index=0, content_index=0, **fields)

    def opening(self) -> bytes:
        s = self.shape
        started = s.response("in_progress", [])
        return (
            s.event("response.created", response=started)
            + s.event("response.in_progress", response=started)
            + s.event("response.output_item.added", output_index=0, item=s.message("", "in_progress"))
            + self._part_event("response.content_part.added", part=responses_wire.output_text(""))
        )

    def add(self, delta: TextDelta) -> bytes:
        super().add(delta)
        if not (self.stream and delta.text):
            return b""
        return self._part_event("response.output_text.delta", delta=delta.text, logprobs=[])

    def closing(self, done: Finished) -> bytes:
        final = self.body(done)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        text = self.text
        return (
            self._part_event("response.output_text.done", text=text, logprobs=[])
            + self._part_event("response.content_part.done", part=responses_wire.output_text(text))
            + self.shape.event("response.output_item.done", output_index=0, item=final["output"][0])
            + self.shape.event(kind, response=final)
        )

    def failure(self, message: str) -> bytes:
        failed = self.shape.response("failed", [], error={"code": "server_error", "message": message})
        return self.shape.event("response.failed", response=failed)

    def body(self, done: Finished) -> dict[str, Any]:
        incomplete = done.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        usage = responses_wire.usage(done.prompt_tokens, done.completion_tokens, done.reused_tokens)
        return self.shape.response(
            status,
            [self.shape.message(self.text, status)],
            usage,
            incomplete="max_output_tokens" if incomplete else None,
        )


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


async def write_answer(
    request: web.Request,
    answer: Answer,
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
    async for event in events:
        if isinstance(event, TextDelta):
            out = answer.add(event)
            if stream is not None and out:
                await stream.write(out)
        elif isinstance(event, Finished):
            await on_finish(event)
            if stream is None:
                return web.json_response(answer.body(event), headers=headers, dumps=_dumps)
            await stream.write(answer.closing(event))
            await stream.write_eof()
            return stream
        elif isinstance(event, Failed):
            if stream is None:
                raise APIError(max(event.status, 500), event.message, type_="server_error")
            await stream.write(answer.failure(event.message))
            await stream.write_eof()
            return stream
    raise AssertionError("the engine's events ended without Finished or Failed")
