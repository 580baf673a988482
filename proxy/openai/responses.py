"""OpenAI Responses API wire objects for locally served turns: the `response` object, its output
items (messages and function calls), its usage, and the documented stream events, each with its
`sequence_number`:

    response.created, response.in_progress, then for each output item in order:
      a message: response.output_item.added, response.content_part.added,
        response.output_text.delta..., response.output_text.done, response.content_part.done,
        response.output_item.done
      a function call: response.output_item.added, response.function_call_arguments.delta,
        response.function_call_arguments.done, response.output_item.done
    then response.completed (or response.incomplete / response.failed)

A stream has no [DONE]: the last event says how the response ended.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from .requests import ResponsesRequest

# Echoed back in the response object as the request gave them (OpenAI does the same).
_ECHOED = ("metadata", "temperature", "top_p", "max_output_tokens", "user", "truncation", "service_tier")


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


@dataclass
class ResponseShape:
    """What the response object repeats in every event: its id, the request's settings, its item id."""

    id: str
    model: str
    request: dict[str, Any]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    created_at: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0

    @classmethod
    def answering(cls, response_id: str, req: ResponsesRequest) -> ResponseShape:
        """The shape of the response `response_id` that answers `req`."""
        return cls(response_id, req.model, req.body, req.instructions, req.previous_response_id, req.store)

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        *,
        incomplete: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": self.instructions,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.request.get("parallel_tool_calls", True) is not False,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.store,
            "text": {"format": _text_format(self.request)},
            "tool_choice": self.request.get("tool_choice") or "auto",
            "tools": self.request.get("tools") or [],
            "usage": usage,
        }
        for name in _ECHOED:
            body[name] = self.request.get(name)
        if body["metadata"] is None:
            body["metadata"] = {}
        if body["truncation"] is None:
            body["truncation"] = "disabled"
        return body

    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE event (`event:` line and `data:`), numbered in order."""
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"


def _text_format(request: dict[str, Any]) -> Any:
    text = request.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    return fmt or {"type": "text"}


def new_item_id(prefix: str) -> str:
    """An output item's id: `msg_...` for a message, `fc_...` for a function call."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An output message: one output_text part (none yet while it is in progress)."""
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [] if status == "in_progress" else [output_text(text)],
    }


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """An output function call (its arguments empty while it is in progress)."""
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "arguments": "" if status == "in_progress" else arguments,
        "call_id": call_id,
        "name": name,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }
