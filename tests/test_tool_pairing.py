"""A tool result answers a call its conversation made, and a call is answered before the conversation
goes on, as OpenAI's and Anthropic's APIs require: a local turn that breaks the rule gets their 400, in
their words (proxy/openai/tool_pairing.py, the Converter of proxy/anthropic/content.py), before the
engine sees it; a turn for an upstream model goes through as it came (the upstream judges its own).

The rules on their own first (no model), then the official openai and anthropic clients over loopback
HTTP against the real model with the ChatML + Hermes tools template.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import orjson
import pytest

from proxy.anthropic.requests import parse_messages
from proxy.errors import APIError
from proxy.openai.tool_pairing import check_chat_tool_replies, check_responses_tool_outputs
from tests.model_fixture import MODEL
from tests.servers import http_request
from tests.support.tools import RESPONSES_TOOLS, TOOLS_TEMPLATE

USER = {"role": "user", "content": "hi"}


def asked(*ids: str) -> dict[str, Any]:
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def answer(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "42"}


NO_CALLS = "must be a response to a preceeding message with 'tool_calls'"
# (messages, param, words of the message): what OpenAI's Chat Completions refuses.
CHAT_REFUSED = {
    "tool-first": ([USER, answer("call_1")], "messages.[1].role", NO_CALLS),
    "tool-after-user": ([USER, asked("call_1"), answer("call_1"), USER, answer("call_1")], "messages.[4].role",
                        NO_CALLS),
    "unknown-id": ([USER, asked("call_1"), answer("call_9")], "messages.[2].tool_call_id",
                   "'tool_call_id' of 'call_9' not found in 'tool_calls' of previous message"),
    "earlier-group-id": ([USER, asked("call_1"), answer("call_1"), asked("call_2"), answer("call_1")],
                         "messages.[4].tool_call_id", "'call_1' not found"),
    "unanswered": ([USER, asked("call_1", "call_2"), answer("call_2"), USER], "messages.[1].role",
                   "did not have response messages: call_1"),
    "unanswered-before-calls": ([USER, asked("call_1"), asked("call_2"), answer("call_2")], "messages.[1].role",
                                "did not have response messages: call_1"),
}  # fmt: skip
CHAT_SERVED = {
    "answered": [USER, asked("call_1"), answer("call_1"), USER],
    "parallel-any-order": [USER, asked("call_1", "call_2"), answer("call_2"), answer("call_1")],
    "ends-on-calls": [USER, asked("call_1")],
    "two-rounds": [USER, asked("call_1"), answer("call_1"), asked("call_2"), answer("call_2"), USER],
}


@pytest.mark.parametrize(("messages", "param", "words"), list(CHAT_REFUSED.values()), ids=list(CHAT_REFUSED))
def test_chat_refuses_a_tool_message_without_its_call_and_a_call_left_unanswered(messages, param, words):
    with pytest.raises(APIError) as refused:
        check_chat_tool_replies(messages)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, None)
    assert words in refused.value.message


@pytest.mark.parametrize("messages", list(CHAT_SERVED.values()), ids=list(CHAT_SERVED))
def test_chat_accepts_every_call_answered_and_a_conversation_ending_on_calls(messages):
    check_chat_tool_replies(messages)


def test_responses_pairs_outputs_with_any_earlier_call():
    check_responses_tool_outputs([USER, asked("call_1", "call_2"), answer("call_1"), answer("call_2"), USER])
    check_responses_tool_outputs([USER, asked("call_1")])  # the next input answers it
    cases = [
        ([USER, answer("call_1")], "No tool call found for function call output with call_id call_1."),
        ([USER, asked("call_1"), answer("call_1"), answer("call_2")], "call_id call_2."),
        ([USER, asked("call_1"), USER], "No tool output found for function call call_1."),
    ]
    for conversation, words in cases:
        with pytest.raises(APIError) as refused:
            check_responses_tool_outputs(conversation)
        assert (refused.value.param, refused.value.code) == ("input", None)
        assert words in refused.value.message


def tool_use(*ids: str) -> dict[str, Any]:
    uses = [{"type": "tool_use", "id": i, "name": "f", "input": {}} for i in ids]
    return {"role": "assistant", "content": [{"type": "text", "text": "Looking."}, *uses]}


def tool_result(*ids: str, text: str | None = None) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    return {"role": "user", "content": [*blocks, *({"type": "tool_result", "tool_use_id": i} for i in ids)]}


def parse(messages: list[dict[str, Any]]) -> None:
    parse_messages(orjson.dumps({"model": "m", "max_tokens": 8, "messages": messages}))


def test_messages_pairs_tool_results_with_the_previous_messages_tool_use():
    parse([USER, tool_use("toolu_1", "toolu_2"), tool_result("toolu_2", "toolu_1"), tool_use("toolu_3")])
    parse([USER, tool_use("toolu_1"), tool_result("toolu_1", text="And?")])  # text beside the result
    cases = [
        ([tool_result("toolu_1")], "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` "
         "blocks: toolu_1. Each `tool_result` block must have a corresponding `tool_use` block in the "
         "previous message."),
        ([USER, tool_use("toolu_1"), tool_result("toolu_1"), USER, tool_result("toolu_1", text="x")],
         "messages.4.content.1: unexpected `tool_use_id`"),
        ([USER, tool_use("toolu_1", "toolu_2"), tool_result("toolu_1")], "messages.1: `tool_use` ids were "
         "found without `tool_result` blocks immediately after: toolu_2. Each `tool_use` block must have a "
         "corresponding `tool_result` block in the next message."),
        ([USER, tool_use("toolu_1"), USER], "messages.1: `tool_use` ids were found"),
    ]  # fmt: skip
    for messages, words in cases:
        with pytest.raises(APIError) as refused:
            parse(messages)
        assert refused.value.status == 400 and refused.value.message.startswith(words), refused.value.message


def test_an_upstream_turn_is_forwarded_unpaired_as_it_came(proxy, fake_upstream):
    messages = [USER, answer("call_1")]
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=30)
    c.chat.completions.create(model="gpt-fake", messages=messages)
    assert fake_upstream.requests[-1].json["messages"] == messages


# ---- the real model behind the proxy ----------------------------------------------------------------


@pytest.mark.model
def test_local_turns_that_break_the_pairing_get_each_apis_400_before_the_engine(local_proxy):
    server = local_proxy(local_runner={"chat_templates": {MODEL: str(TOOLS_TEMPLATE)}})
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model=MODEL, messages=[USER, answer("call_1")], max_tokens=2)
    assert (refused.value.param, refused.value.code) == ("messages.[1].role", None)
    assert NO_CALLS in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        output = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
        c.responses.create(model=MODEL, input=[USER, output], max_output_tokens=2)
    assert refused.value.body == {
        "message": "No tool call found for function call output with call_id call_1.",
        "type": "invalid_request_error",
        "param": "input",
        "code": None,
    }
    a = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as rejected:
        a.messages.create(model=MODEL, max_tokens=2, messages=[USER, tool_use("toolu_1"), USER])
    assert rejected.value.body["error"]["message"].startswith("messages.1: `tool_use` ids were found")
    stats = http_request("GET", server.url + "/v1/attention_store/stats").json()
    assert stats["runner"]["admitted"] == 0, stats["runner"]  # nothing reached the engine

    # A previous response's call is answered by the next input, or the conversation cannot go on.
    first = c.responses.create(
        model=MODEL,
        input="Is it warm in Lisbon today?",
        tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
    )
    call = first.output[0]
    with pytest.raises(openai.BadRequestError) as refused:
        c.responses.create(
            model=MODEL, previous_response_id=first.id, input="And Porto?", max_output_tokens=2
        )
    assert refused.value.body["message"] == f"No tool output found for function call {call.call_id}."
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}
    follow_up = c.responses.create(
        model=MODEL, previous_response_id=first.id, input=[output], tools=RESPONSES_TOOLS, max_output_tokens=4
    )
    assert follow_up.status in ("completed", "incomplete")
