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

import hashlib
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


# -- a stored response's input items (GET /v1/responses/{id}/input_items) ------------------------------


def _derived_id(prefix: str, position: tuple[int, int], message: dict[str, Any]) -> str:
    """An input item's id, derived from where it sits in the conversation and what it says: the same at
    every listing and for every response of the chain that holds it. (The conversation keeps chat
    messages, not the ids its items had as an earlier response's output; call ids are kept.)"""
    digest = hashlib.sha256(orjson.dumps([*position, message], option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"{prefix}_{digest[:32]}"


def input_items(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation's chat messages (every earlier input and output; the instructions are not items)
    as the Responses items they were: messages, an assistant's calls as `function_call` items after its
    text, tool messages as `function_call_output` items. Oldest first."""
    items: list[dict[str, Any]] = []
    for i, message in enumerate(conversation):
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            item_id = _derived_id("fco", (i, 0), message)
            items.append(
                {
                    "id": item_id,
                    "type": "function_call_output",
                    "status": "completed",
                    "call_id": message["tool_call_id"],
                    "output": content,
                }
            )
        elif role == "assistant":
            if content:
                items.append(message_item(_derived_id("msg", (i, 0), message), content, "completed"))
            for j, call in enumerate(message.get("tool_calls") or (), start=1):
                fn = call["function"]
                item_id = _derived_id("fc", (i, j), message)
                items.append(
                    function_call_item(item_id, call["id"], fn["name"], fn["arguments"], "completed")
                )
        else:
            items.append(
                {
                    "id": _derived_id("msg", (i, 0), message),
                    "type": "message",
                    "status": "completed",
                    "role": role,
                    "content": [{"type": "input_text", "text": content}],
                }
            )
    return items


def item_page(
    items: list[dict[str, Any]], *, limit: int, descending: bool, after: str | None
) -> dict[str, Any]:
    """One page of a list of items, as OpenAI's cursor pages are: `limit` items in the order asked,
    those after the item `after` (None: from the first); `has_more` when the list goes on."""
    ordered = items[::-1] if descending else items
    start = 0
    if after is not None:
        start = next(k for k, item in enumerate(ordered) if item["id"] == after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }
