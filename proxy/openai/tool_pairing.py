"""Tool calls and their results paired, as OpenAI's API requires of a conversation before its model sees
it, with OpenAI's own errors (their words, `param` as OpenAI writes it, `code` null):

    chat       a `tool` message answers a call of the assistant message its group follows:
                 "Invalid parameter: messages with role 'tool' must be a response to a preceeding
                  message with 'tool_calls'."                                     messages.[i].role
                 "Invalid parameter: 'tool_call_id' of 'call_x' not found in 'tool_calls' of previous
                  message."                                                       messages.[i].tool_call_id
               and every call is answered before the conversation goes on:
                 "An assistant message with 'tool_calls' must be followed by tool messages responding
                  to each 'tool_call_id'. The following tool_call_ids did not have response messages:
                  call_x"                                                         messages.[i].role
    responses  a `function_call_output` answers a call made earlier in the conversation (the input's,
               or a previous response's):
                 "No tool call found for function call output with call_id call_x."          input
               and a call is answered before the conversation goes on past it:
                 "No tool output found for function call call_x."                            input

A conversation that ends on unanswered calls is left alone (the model continues after them). The check
runs on local turns only: an upstream judges its own requests (OpenAI-compatible servers such as vLLM
accept unpaired histories), so forwarding stays transparent. Anthropic's rule, per message, is checked
where its content is converted (proxy/anthropic/content.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import bad_request


def _call_ids(message: dict[str, Any]) -> list[str]:
    """The ids of an assistant message's tool calls (none for any other message)."""
    if message.get("role") != "assistant":
        return []
    return [call["id"] for call in message.get("tool_calls") or ()]


def check_chat_tool_replies(messages: Sequence[dict[str, Any]]) -> None:
    """A chat conversation's tool messages each answer a call of the assistant message before their
    group, and no call is left unanswered when another message follows; else OpenAI's 400."""
    group_at = -1  # the assistant message whose calls the tool messages now answer
    waiting: list[str] = []  # its calls not answered yet
    calls: set[str] = set()
    for i, message in enumerate(messages):
        if message.get("role") == "tool":
            if group_at < 0:
                raise bad_request(
                    "Invalid parameter: messages with role 'tool' must be a response to a preceeding "
                    "message with 'tool_calls'.",
                    param=f"messages.[{i}].role",
                )
            call_id = message["tool_call_id"]
            if call_id not in calls:
                raise bad_request(
                    f"Invalid parameter: 'tool_call_id' of '{call_id}' not found in 'tool_calls' of "
                    "previous message.",
                    param=f"messages.[{i}].tool_call_id",
                )
            if call_id in waiting:
                waiting.remove(call_id)
            continue
        if waiting:
            raise bad_request(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to "
                "each 'tool_call_id'. The following tool_call_ids did not have response messages: "
                + ", ".join(waiting),
                param=f"messages.[{group_at}].role",
            )
        ids = _call_ids(message)
        group_at, waiting, calls = (i, list(ids), set(ids)) if ids else (-1, [], set())


def check_responses_tool_outputs(conversation: Sequence[dict[str, Any]]) -> None:
    """A Responses conversation (as chat messages: a previous response's, then the new input) answers
    only calls made before the answer, and leaves none unanswered where the conversation goes on past
    it; else OpenAI's 400."""
    made: set[str] = set()
    waiting: list[str] = []
    for message in conversation:
        if message.get("role") == "tool":
            call_id = message["tool_call_id"]
            if call_id not in made:
                raise bad_request(
                    f"No tool call found for function call output with call_id {call_id}.", param="input"
                )
            if call_id in waiting:
                waiting.remove(call_id)
            continue
        if waiting:
            raise bad_request(f"No tool output found for function call {waiting[0]}.", param="input")
        ids = _call_ids(message)
        made.update(ids)
        waiting.extend(ids)
