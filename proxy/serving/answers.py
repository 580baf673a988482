"""The answer writer: an engine's events as the client's answer, in the shape of the API it called,
streamed (SSE) or as one JSON body. Written once for every engine.

`write_answer` drives it: the headers go out with the first token (the turn's TTFT and hit level are in
them), text streams as it comes, `on_finish` runs before the client sees the end (so its next turn
finds the session indexed), and an error after the headers went out is reported in-band, as OpenAI
does mid-stream. Each API's format records the answer (`add`) and says what bytes each moment is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import orjson
from aiohttp import web

from engine_api.sampling import TokenLogprob
from engine_api.turn import Failed, Finished, TextDelta

from ..errors import APIError, error_body
from ..openai import chat as chat_wire
from ..openai import completions as completion_wire
from ..openai import responses as responses_wire
from .choices import Indexed
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
    """The answer so far (one text per choice: n > 1 answers at once), and the bytes of each moment of
    its stream. Subclasses say what those bytes are."""

    def __init__(self, *, stream: bool, n: int = 1) -> None:
        self.stream = stream
        self.parts: list[list[str]] = [[] for _ in range(n)]
        self.done: list[Finished | None] = [None] * n

    @property
    def text(self) -> str:
        """The first choice's text (the Responses API has one)."""
        return self.choice_text(0)

    def choice_text(self, index: int) -> str:
        return "".join(self.parts[index])

    def opening(self) -> bytes:
        return b""

    def add(self, index: int, delta: TextDelta) -> bytes:
        """Record a delta; the stream's bytes for it (b"" when nothing can go out yet)."""
        self.parts[index].append(delta.text)
        return b""

    def end_choice(self, index: int, done: Finished) -> bytes:
        """Record that a choice ended; the stream's bytes for it."""
        self.done[index] = done
        return b""

    def closing(self, total: Finished) -> bytes:
        """Every choice has ended: the stream's last bytes (`total`: the turn's tokens, all choices)."""
        raise NotImplementedError

    def failure(self, message: str, status: int = 500) -> bytes:
        """The in-band error of a stream that already began (`status`: what the error would have been
        had it come before the first byte)."""
        return sse_error(message)

    def ended_in_tool_calls(self) -> bool:
        """Whether the answer hands the turn to a tool (the agent will come back with its result): the
        store then retains the session's KV through the wait."""
        return False

    def body(self, total: Finished) -> dict[str, Any]:
        raise NotImplementedError


class _Choice:
    """One chat choice's own state: its tool-call parser, its log-probabilities, the calls it sent."""

    def __init__(self, tools: ToolCallParser | None) -> None:
        self.tools = tools
        self.logprobs: list[dict[str, Any]] = []
        self.calls_sent = 0

    def reason(self, done: Finished) -> str:
        return "tool_calls" if self.tools is not None and self.tools.calls else _finish_reason(done)


class ChatAnswer(Answer):
    """Chat Completions: content deltas, tool calls parsed out of the text (when the request has tools),
    log-probabilities per token (when asked), n choices."""

    def __init__(
        self,
        model: str,
        fingerprint: str,
        *,
        stream: bool,
        include_usage: bool,
        n: int = 1,
        tools: Callable[[], ToolCallParser] | None = None,
        decode: Decode | None = None,
    ) -> None:
        super().__init__(stream=stream, n=n)
        self.ids = chat_wire.CompletionIds(model=model, system_fingerprint=fingerprint)
        self.include_usage = include_usage
        self.choices = [_Choice(tools() if tools is not None else None) for _ in range(n)]
        self.decode = decode  # set when logprobs were asked for

    def ended_in_tool_calls(self) -> bool:
        return any(c.tools is not None and c.tools.calls for c in self.choices)

    def _chunk(self, index: int, delta: dict[str, Any], reason: str | None = None, **kw: Any) -> bytes:
        return chat_wire.chunk(self.ids, delta, reason, index=index, include_usage=self.include_usage, **kw)

    def opening(self) -> bytes:
        role = {"role": "assistant", "content": "", "refusal": None}
        return b"".join(self._chunk(i, role) for i in range(len(self.choices)))

    def add(self, index: int, delta: TextDelta) -> bytes:
        super().add(index, delta)
        choice = self.choices[index]
        entries = self._logprob_entries(choice, delta.logprobs)
        content = delta.text
        calls: tuple[ToolCall, ...] = ()
        if choice.tools is not None:
            parsed = choice.tools.feed(delta.text)
            content, calls = parsed.content, parsed.calls
        if not self.stream:
            return b""
        out = b""
        if content or entries:
            out += self._chunk(index, {"content": content}, logprobs_=_logprobs_body(entries))
        return out + self._calls(index, calls)

    def _calls(self, index: int, calls: Sequence[ToolCall]) -> bytes:
        choice, out = self.choices[index], b""
        for call in calls:
            out += self._chunk(index, {"tool_calls": [call.to_openai(choice.calls_sent)]})
            choice.calls_sent += 1
        return out

    def _logprob_entries(self, choice: _Choice, logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
        if self.decode is None or not logprobs:
            return []
        entries = [_logprob_entry(lp, self.decode) for lp in logprobs]
        choice.logprobs.extend(entries)
        return entries

    def end_choice(self, index: int, done: Finished) -> bytes:
        super().end_choice(index, done)
        choice = self.choices[index]
        content = ""
        calls: tuple[ToolCall, ...] = ()
        if choice.tools is not None:
            parsed = choice.tools.finish()  # what the parser still held
            content, calls = parsed.content, parsed.calls
        if not self.stream:
            return b""
        out = self._chunk(index, {"content": content}) if content else b""
        return out + self._calls(index, calls) + self._chunk(index, {}, choice.reason(done))

    def closing(self, total: Finished) -> bytes:
        if not self.include_usage:
            return chat_wire.DONE
        return chat_wire.chunk(self.ids, None, include_usage=True, usage_=_usage(total)) + chat_wire.DONE

    def body(self, total: Finished) -> dict[str, Any]:
        bodies = []
        for index, choice in enumerate(self.choices):
            done = self.done[index]
            assert done is not None
            message: dict[str, Any] = {
                "role": "assistant",
                "content": self.choice_text(index),
                "refusal": None,
            }
            if choice.tools is not None:
                content = "".join(choice.tools.content)
                message["content"] = content if content or not choice.tools.calls else None
                if choice.tools.calls:
                    message["tool_calls"] = [c.to_openai() for c in choice.tools.calls]
            logprobs = _logprobs_body(choice.logprobs) if self.decode is not None else None
            bodies.append(chat_wire.choice(index, message, choice.reason(done), logprobs))
        return chat_wire.completion(self.ids, bodies, _usage(total))


def _logprob_entry(lp: TokenLogprob, decode: Decode) -> dict[str, Any]:
    def one(token: int, logprob: float) -> dict[str, Any]:
        text = decode(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}


def _logprobs_body(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    return {"content": entries, "refusal": None} if entries else None


class CompletionAnswer(Answer):
    def __init__(
        self, model: str, fingerprint: str, *, stream: bool, include_usage: bool, n: int = 1
    ) -> None:
        super().__init__(stream=stream, n=n)
        self.ids = completion_wire.text_completion_ids(model, fingerprint)
        self.include_usage = include_usage

    def add(self, index: int, delta: TextDelta) -> bytes:
        super().add(index, delta)
        if not (self.stream and delta.text):
            return b""
        return completion_wire.chunk(self.ids, delta.text, index=index, include_usage=self.include_usage)

    def end_choice(self, index: int, done: Finished) -> bytes:
        super().end_choice(index, done)
        if not self.stream:
            return b""
        reason = _finish_reason(done)
        return completion_wire.chunk(self.ids, "", reason, index=index, include_usage=self.include_usage)

    def body(self, total: Finished) -> dict[str, Any]:
        choices = []
        for index, done in enumerate(self.done):
            assert done is not None
            choices.append(completion_wire.choice(self.choice_text(index), _finish_reason(done), index))
        return {**completion_wire.envelope(self.ids, choices), "usage": _usage(total)}

    def closing(self, total: Finished) -> bytes:
        if not self.include_usage:
            return chat_wire.DONE
        return completion_wire.chunk(self.ids, None, include_usage=True, usage=_usage(total)) + chat_wire.DONE


class _Item:
    """One output item of a Responses answer: a message (its text so far), or a function call."""

    def __init__(self, item_id: str, index: int, call: ToolCall | None = None) -> None:
        self.id = item_id
        self.index = index  # its place in the response's output
        self.call = call
        self.texts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def wire(self, status: str) -> dict[str, Any]:
        if self.call is None:
            return responses_wire.message_item(self.id, self.text, status)
        call = self.call
        return responses_wire.function_call_item(self.id, call.id, call.name, call.arguments, status)


class ResponsesAnswer(Answer):
    """The Responses API: the answer's output items in order, a message (one output_text part) for its
    text and, when the request has tools, a function_call item for each call parsed out of it.

    Without tools the one message opens with the stream, before any text. With tools a message opens
    at its first text and closes when a call or the end comes; a call goes out whole once the parser
    has seen its end (its arguments in one delta), as the chat stream sends it."""

    def __init__(
        self, shape: responses_wire.ResponseShape, *, stream: bool, tools: ToolCallParser | None = None
    ) -> None:
        super().__init__(stream=stream)
        self.shape = shape
        self.tools = tools
        self.items: list[_Item] = []
        self._open: _Item | None = None  # the message being written
        # With tools, whitespace alone is held until text follows: a model writes a newline between
        # its calls and after the last one, which is no message (and its stored conversation then
        # re-renders to the tokens it computed).
        self._held = ""

    def ended_in_tool_calls(self) -> bool:
        return any(item.call is not None for item in self.items)

    def as_message(self) -> dict[str, Any]:
        """The answer as the chat message a follow-up's conversation holds: the model's own text
        without tools (so the next turn re-renders the tokens it wrote), else the text the client saw
        and the calls."""
        if self.tools is None:
            return {"role": "assistant", "content": self.text}
        content = "".join(item.text for item in self.items if item.call is None)
        calls = [item.call.to_openai() for item in self.items if item.call is not None]
        if calls:  # the template puts its own newline between the text and the calls
            content = content.strip()
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return message

    # -- the stream's moments ------------------------------------------------------------------------

    def _emit(self, kind: str, **fields: Any) -> bytes:
        return self.shape.event(kind, **fields) if self.stream else b""

    def _part_event(self, kind: str, item: _Item, **fields: Any) -> bytes:
        return self._emit(kind, item_id=item.id, output_index=item.index, content_index=0, **fields)

    def opening(self) -> bytes:
        s = self.shape
        started = s.response("in_progress", [])
        out = s.event("response.created", response=started) + s.event(
            "response.in_progress", response=started
        )
        return out + (self._open_message() if self.tools is None else b"")

    def add(self, index: int, delta: TextDelta) -> bytes:
        super().add(index, delta)
        if self.tools is None:
            return self._text(delta.text)
        parsed = self.tools.feed(delta.text)
        return self._text(parsed.content) + self._calls(parsed.calls)

    def end_choice(self, index: int, done: Finished) -> bytes:
        super().end_choice(index, done)
        out = b""
        if self.tools is not None:
            parsed = self.tools.finish()  # what the parser still held
            out = self._text(parsed.content) + self._calls(parsed.calls)
            held, self._held = self._held, ""
            if held and self._open is not None:  # the answer's own trailing whitespace, after its text
                self._open.texts.append(held)
                out += self._part_event("response.output_text.delta", self._open, delta=held, logprobs=[])
        if not self.items:  # an empty answer is one empty message (before any body of it is taken)
            out += self._open_message()
        return out

    def closing(self, total: Finished) -> bytes:
        final = self.body(total)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return self._close_message(final["status"]) + self.shape.event(kind, response=final)

    def failure(self, message: str, status: int = 500) -> bytes:
        failed = self.shape.response("failed", [], error={"code": "server_error", "message": message})
        return self.shape.event("response.failed", response=failed)

    def body(self, total: Finished) -> dict[str, Any]:
        incomplete = total.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        # The last message is what the end cut short, when it was; every earlier item was whole.
        last = self.items[-1]
        output = [
            item.wire(status if item is last and item.call is None else "completed") for item in self.items
        ]
        usage = responses_wire.usage(total.prompt_tokens, total.completion_tokens, total.reused_tokens)
        return self.shape.response(
            status, output, usage, incomplete="max_output_tokens" if incomplete else None
        )

    # -- items ---------------------------------------------------------------------------------------

    def _open_message(self) -> bytes:
        item = self._open = _Item(responses_wire.new_item_id("msg"), len(self.items))
        self.items.append(item)
        index = item.index
        return self._emit(
            "response.output_item.added", output_index=index, item=item.wire("in_progress")
        ) + self._part_event("response.content_part.added", item, part=responses_wire.output_text(""))

    def _text(self, text: str) -> bytes:
        if self.tools is not None:
            text, self._held = self._held + text, ""
            if text.isspace():
                self._held = text
                return b""
        if not text:
            return b""
        out = self._open_message() if self._open is None else b""
        assert self._open is not None
        self._open.texts.append(text)
        return out + self._part_event("response.output_text.delta", self._open, delta=text, logprobs=[])

    def _close_message(self, status: str = "completed") -> bytes:
        item = self._open
        if item is None:
            return b""
        self._open = None
        text, index = item.text, item.index
        return (
            self._part_event("response.output_text.done", item, text=text, logprobs=[])
            + self._part_event("response.content_part.done", item, part=responses_wire.output_text(text))
            + self._emit("response.output_item.done", output_index=index, item=item.wire(status))
        )

    def _calls(self, calls: Sequence[ToolCall]) -> bytes:
        if calls:
            self._held = ""  # the whitespace before a call is the format's, not the answer's
        out = self._close_message() if calls else b""
        for call in calls:
            item = _Item(responses_wire.new_item_id("fc"), len(self.items), call)
            self.items.append(item)
            index, fields = item.index, {"item_id": item.id}
            out += (
                self._emit("response.output_item.added", output_index=index, item=item.wire("in_progress"))
                + self._emit(
                    "response.function_call_arguments.delta",
                    **fields,
                    output_index=index,
                    delta=call.arguments,
                )
                + self._emit(
                    "response.function_call_arguments.done",
                    **fields,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
                + self._emit("response.output_item.done", output_index=index, item=item.wire("completed"))
            )
        return out


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def total_of(done: list[Finished | None]) -> Finished:
    """The turn's end over its choices: the first's prompt, reuse and saved chunks; every choice's
    answer tokens (OpenAI's usage counts them all)."""
    first = done[0]
    assert first is not None and all(d is not None for d in done)
    completion = sum(d.completion_tokens for d in done if d is not None)
    return dataclasses.replace(first, completion_tokens=completion)


async def write_answer(
    request: web.Request,
    answer: Answer,
    headers: dict[str, str],
    events: AsyncIterator[Indexed],
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
    async for index, event in events:
        out = b""
        if isinstance(event, TextDelta):
            out = answer.add(index, event)
        elif isinstance(event, Finished):
            out = answer.end_choice(index, event)
            if all(d is not None for d in answer.done):
                total = total_of(answer.done)
                await on_finish(total)
                if stream is None:
                    return web.json_response(answer.body(total), headers=headers, dumps=_dumps)
                await stream.write(out + answer.closing(total))
                await stream.write_eof()
                return stream
        elif isinstance(event, Failed):
            if stream is None:
                raise APIError(max(event.status, 500), event.message, type_="server_error")
            await stream.write(answer.failure(event.message, event.status))
            await stream.write_eof()
            return stream
        if stream is not None and out:
            await stream.write(out)
    raise AssertionError("the engine's events ended without Finished or Failed")
