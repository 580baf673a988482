"""The Anthropic Messages answer: an engine's events as a message of content blocks (text, tool_use), or
as Anthropic's stream of events. An `Answer` like the others: `write_answer` drives it.

The model's text goes through the chat path's tool-call parser (when the request has tools): text the
client may see becomes a text block, a parsed call a tool_use block whose `input` is the call's
arguments as an object. Streamed, a text block opens at its first text and closes when a call or the
end comes; a call goes out whole (content_block_start, one input_json_delta, content_block_stop), as the
parser yields calls once their end is seen.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from engine_api.turn import Finished, TextDelta

from ..anthropic import messages as wire
from .answers import Answer
from .tools import ToolCall, ToolCallParser


def _input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as the object tool_use carries; arguments that are JSON but not an object
    (a model writing its call loosely) are kept under "arguments" rather than dropped."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        arguments = call.arguments
    return arguments if isinstance(arguments, dict) else {"arguments": arguments}


class MessagesAnswer(Answer):
    def __init__(
        self,
        model: str,
        *,
        stream: bool,
        accounting: wire.CacheAccounting,
        prompt: int,
        reused: int,
        tools: ToolCallParser | None = None,
        stop_sequences: tuple[str, ...] = (),
        hour: bool = False,
    ) -> None:
        super().__init__(stream=stream)
        # The client's own: a stop string the proxy adds (the end of a call) is never reported as one.
        self.stop_sequences = stop_sequences
        self.hour = hour  # the turn asked for a 1h cache: usage counts what it stored as such
        self.id = wire.new_message_id()
        self.model = model
        self.accounting = accounting
        self.prompt, self.reused = prompt, reused  # known at the first token: message_start reports them
        self.tools = tools
        self.blocks: list[dict[str, Any]] = []
        self._open_text: int | None = None  # the text block being written, by index

    def ended_in_tool_calls(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    # -- the stream's moments ------------------------------------------------------------------------

    def opening(self) -> bytes:
        stored = self.accounting.stored_prompt_tokens(self.prompt, None)
        usage = self.accounting.usage(self.prompt, self.reused, 0, stored, hour=self.hour)
        start = wire.message(self.id, self.model, [], usage)
        return wire.event("message_start", message=start) + wire.event("ping")

    def add(self, index: int, delta: TextDelta) -> bytes:
        super().add(index, delta)
        if self.tools is None:
            return self._text(delta.text)
        parsed = self.tools.feed(delta.text)
        return self._text(parsed.content) + self._tool_uses(parsed.calls)

    def end_choice(self, index: int, done: Finished) -> bytes:
        super().end_choice(index, done)
        out = b""
        if self.tools is not None:
            parsed = self.tools.finish()  # what the parser still held
            out = self._text(parsed.content) + self._tool_uses(parsed.calls)
        return out + self._close_text()

    def closing(self, total: Finished) -> bytes:
        delta = {"stop_reason": self._stop_reason(total), "stop_sequence": self._stop_sequence(total)}
        return wire.event("message_delta", delta=delta, usage=self._usage(total)) + wire.event("message_stop")

    def failure(self, message: str, status: int = 500) -> bytes:
        return wire.error_event(message, status)  # Anthropic's SDKs choose the exception by its type

    def body(self, total: Finished) -> dict[str, Any]:
        return wire.message(
            self.id,
            self.model,
            self.blocks,
            self._usage(total),
            self._stop_reason(total),
            self._stop_sequence(total),
        )

    # -- blocks --------------------------------------------------------------------------------------

    def _emit(self, kind: str, **fields: Any) -> bytes:
        return wire.event(kind, **fields) if self.stream else b""

    def _text(self, text: str) -> bytes:
        if not text:
            return b""
        out = b""
        if self._open_text is None:
            self._open_text = len(self.blocks)
            self.blocks.append(wire.text_block(""))
            out += self._emit("content_block_start", index=self._open_text, content_block=wire.text_block(""))
        self.blocks[self._open_text]["text"] += text
        delta = {"type": "text_delta", "text": text}
        return out + self._emit("content_block_delta", index=self._open_text, delta=delta)

    def _close_text(self) -> bytes:
        if self._open_text is None:
            return b""
        index, self._open_text = self._open_text, None
        return self._emit("content_block_stop", index=index)

    def _tool_uses(self, calls: tuple[ToolCall, ...]) -> bytes:
        out = b""
        for call in calls:
            out += self._close_text()
            index = len(self.blocks)
            arguments = _input(call)
            self.blocks.append(wire.tool_use_block(wire.tool_use_id(), call.name, arguments))
            start = {**self.blocks[index], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": orjson.dumps(arguments).decode()}
            out += (
                self._emit("content_block_start", index=index, content_block=start)
                + self._emit("content_block_delta", index=index, delta=delta)
                + self._emit("content_block_stop", index=index)
            )
        return out

    # -- the end -------------------------------------------------------------------------------------

    def _stop_reason(self, total: Finished) -> str:
        if self.ended_in_tool_calls():
            return "tool_use"
        if total.finish_reason == "length":
            return "max_tokens"
        return "stop_sequence" if total.stop_sequence in self.stop_sequences else "end_turn"

    def _stop_sequence(self, total: Finished) -> str | None:
        return total.stop_sequence if self._stop_reason(total) == "stop_sequence" else None

    def _usage(self, total: Finished) -> dict[str, Any]:
        stored = (
            self.accounting.stored_prompt_tokens(total.prompt_tokens, total.completion_tokens)
            if total.chunk_keys
            else 0
        )
        return self.accounting.usage(
            total.prompt_tokens, total.reused_tokens, total.completion_tokens, stored, hour=self.hour
        )
