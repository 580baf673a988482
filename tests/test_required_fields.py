"""Every field OpenAI requires in a turn's messages is required here too (issue 39): a request without one
gets OpenAI's 400, `param` naming the field as OpenAI does (`messages[0].content`) and `code` saying
what is wrong, before it is routed: the upstream never sees it and the local model never serves it.

The official `openai` client sends each body over loopback HTTP; one case per required field, for Chat
Completions, Completions and Responses. With the real model behind the proxy, the issue's own request
(a user message without content) is refused, and messages that leave out only what OpenAI lets them
leave out (an assistant's content beside its tool calls) are still served.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.model_fixture import MODEL
from tests.servers import http_request

UPSTREAM_MODEL = "gpt-fake"
USER = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
ASKED = {"role": "assistant", "tool_calls": [CALL]}  # content may be left out beside tool calls
MISSING = "missing_required_parameter"
INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"


def without(obj: dict[str, Any], path: str) -> dict[str, Any]:
    """A deep copy of `obj` with the dotted `path` removed."""
    head, _, rest = path.partition(".")
    out = dict(obj)
    if rest:
        out[head] = without(obj[head], rest)
    else:
        del out[head]
    return out


def part(kind: str, **fields: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": kind, **fields}]}


TEXT_PART = {"type": "text", "text": "hi"}
IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
AUDIO_PART = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
CUSTOM_CALL = {"id": "call_2", "type": "custom", "custom": {"name": "g", "input": "x"}}

# (messages, param, code): one missing or malformed required field each.
CHAT_CASES = {
    "user.content": ([{"role": "user"}], "messages[0].content", MISSING),
    "user.content-null": ([{"role": "user", "content": None}], "messages[0].content", INVALID_TYPE),
    "user.content-number": ([{"role": "user", "content": 7}], "messages[0].content", INVALID_TYPE),
    "system.content": ([{"role": "system"}, USER], "messages[0].content", MISSING),
    "developer.content": ([{"role": "developer"}, USER], "messages[0].content", MISSING),
    "assistant.content": ([USER, {"role": "assistant"}, USER], "messages[1].content", MISSING),
    "tool.content": ([USER, ASKED, {"role": "tool", "tool_call_id": "call_1"}], "messages[2].content", MISSING),
    "tool.tool_call_id": ([USER, ASKED, {"role": "tool", "content": "42"}], "messages[2].tool_call_id", MISSING),
    "function.name": ([USER, {"role": "function", "content": "42"}], "messages[1].name", MISSING),
    "function.content": ([USER, {"role": "function", "name": "f"}], "messages[1].content", MISSING),
    "message.role": ([{"content": "hi"}], "messages[0].role", MISSING),
    "message.role-unknown": ([{"role": "robot", "content": "hi"}], "messages[0].role", INVALID_VALUE),
    "message.object": (["hi"], "messages[0]", INVALID_TYPE),
    "part.type": ([{"role": "user", "content": [{"text": "hi"}]}], "messages[0].content[0].type", MISSING),
    "part.type-for-role": (
        [{"role": "system", "content": [IMAGE_PART]}, USER], "messages[0].content[0].type", INVALID_VALUE,
    ),
    "text.text": ([part("text")], "messages[0].content[0].text", MISSING),
    "image_url.image_url": ([part("image_url")], "messages[0].content[0].image_url", MISSING),
    "image_url.url": ([part("image_url", image_url={})], "messages[0].content[0].image_url.url", MISSING),
    "input_audio.data": (
        [{"role": "user", "content": [without(AUDIO_PART, "input_audio.data")]}],
        "messages[0].content[0].input_audio.data", MISSING,
    ),
    "input_audio.format": (
        [{"role": "user", "content": [without(AUDIO_PART, "input_audio.format")]}],
        "messages[0].content[0].input_audio.format", MISSING,
    ),
    "file.file": ([part("file")], "messages[0].content[0].file", MISSING),
    "refusal.refusal": (
        [USER, {"role": "assistant", "content": [{"type": "refusal"}]}, USER],
        "messages[1].content[0].refusal", MISSING,
    ),
    "tool_calls.array": (
        [USER, {"role": "assistant", "tool_calls": CALL}], "messages[1].tool_calls", INVALID_TYPE,
    ),
    **{
        f"tool_calls.{path}": (
            [USER, {"role": "assistant", "tool_calls": [without(CALL, path)]}],
            f"messages[1].tool_calls[0].{path}", MISSING,
        )
        for path in ("id", "type", "function", "function.name", "function.arguments")
    },
    "tool_calls.type-unknown": (
        [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "shell"}]}],
        "messages[1].tool_calls[0].type", INVALID_VALUE,
    ),
    **{
        f"custom_tool_calls.{path}": (
            [USER, {"role": "assistant", "tool_calls": [without(CUSTOM_CALL, path)]}],
            f"messages[1].tool_calls[0].{path}", MISSING,
        )
        for path in ("custom.name", "custom.input")
    },
    **{
        f"function_call.{name}": (
            [USER, {"role": "assistant", "function_call": without({"name": "f", "arguments": "{}"}, name)}],
            f"messages[1].function_call.{name}", MISSING,
        )
        for name in ("name", "arguments")
    },
}  # fmt: skip

MESSAGE = {"role": "user", "content": "hi"}
FUNCTION_CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
FUNCTION_OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "42"}

# (input, param, code) for the Responses API.
RESPONSES_CASES = {
    "message.content": ([{"role": "user"}], "input[0].content", MISSING),
    "message.role": ([{"content": "hi"}], "input[0].role", MISSING),
    "message.role-unknown": ([{"type": "message", "role": "tool", "content": "x"}], "input[0].role", INVALID_VALUE),
    "message.content-number": ([{"role": "user", "content": 3}], "input[0].content", INVALID_TYPE),
    "item.object": ([7], "input[0]", INVALID_TYPE),
    "part.type": ([{"role": "user", "content": [{"text": "hi"}]}], "input[0].content[0].type", MISSING),
    "input_text.text": ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text", MISSING),
    "output_text.text": (
        [MESSAGE, {"role": "assistant", "content": [{"type": "output_text"}]}], "input[1].content[0].text", MISSING,
    ),
    **{
        f"function_call.{name}": ([MESSAGE, without(FUNCTION_CALL, name)], f"input[1].{name}", MISSING)
        for name in ("call_id", "name", "arguments")
    },
    **{
        f"function_call_output.{name}": (
            [MESSAGE, FUNCTION_CALL, without(FUNCTION_OUTPUT, name)], f"input[2].{name}", MISSING,
        )
        for name in ("call_id", "output")
    },
    "item_reference.id": ([MESSAGE, {"type": "item_reference"}], "input[1].id", MISSING),
    "function_call_output.part.type": (
        [MESSAGE, FUNCTION_CALL, {**FUNCTION_OUTPUT, "output": [{"text": "x"}]}], "input[2].output[0].type", MISSING,
    ),
    "function_call_output.part.text": (
        [MESSAGE, FUNCTION_CALL, {**FUNCTION_OUTPUT, "output": [{"type": "input_text"}]}], "input[2].output[0].text",
        MISSING,
    ),
    "function_call_output.part.object": (
        [MESSAGE, FUNCTION_CALL, {**FUNCTION_OUTPUT, "output": ["x"]}], "input[2].output[0]", INVALID_TYPE,
    ),
}  # fmt: skip


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="key", max_retries=0, timeout=60)


def assert_refused(refused: pytest.ExceptionInfo[openai.BadRequestError], param: str, code: str) -> None:
    error = refused.value
    assert error.status_code == 400
    assert isinstance(error.body, dict) and set(error.body) == {"message", "type", "param", "code"}
    assert error.body["type"] == "invalid_request_error"
    assert (error.param, error.code) == (param, code), error.body
    # OpenAI's wording: the missing or mistyped field named in the message too, a bad value quoted.
    assert (param if code != INVALID_VALUE else "Supported values are") in error.body["message"]


@pytest.mark.parametrize(("messages", "param", "code"), list(CHAT_CASES.values()), ids=list(CHAT_CASES))
def test_a_chat_message_without_a_required_field_is_refused_naming_it(
    proxy, fake_upstream, messages, param, code
):
    with pytest.raises(openai.BadRequestError) as refused:
        client(proxy).chat.completions.create(model=UPSTREAM_MODEL, messages=messages)
    assert_refused(refused, param, code)
    assert fake_upstream.requests == []  # refused before it was routed


@pytest.mark.parametrize(
    ("items", "param", "code"), list(RESPONSES_CASES.values()), ids=list(RESPONSES_CASES)
)
def test_a_responses_item_without_a_required_field_is_refused_naming_it(
    proxy, fake_upstream, items, param, code
):
    with pytest.raises(openai.BadRequestError) as refused:
        client(proxy).responses.create(model=UPSTREAM_MODEL, input=items)
    assert_refused(refused, param, code)
    assert fake_upstream.requests == []


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/chat/completions", {"model": UPSTREAM_MODEL}, "messages"),
        ("/chat/completions", {"messages": [USER]}, "model"),
        ("/completions", {"model": UPSTREAM_MODEL}, "prompt"),
        ("/completions", {"prompt": "hi"}, "model"),
        ("/responses", {"input": "hi"}, "model"),
    ],
    ids=["chat.messages", "chat.model", "completions.prompt", "completions.model", "responses.model"],
)
def test_a_request_without_a_required_top_level_field_is_refused_naming_it(
    proxy, fake_upstream, path, body, param
):
    with pytest.raises(openai.BadRequestError) as refused:
        client(proxy).post(path, body=body, cast_to=object)
    assert_refused(refused, param, MISSING)
    assert fake_upstream.requests == []


@pytest.mark.parametrize(
    "messages",
    [
        [USER, ASKED, {"role": "tool", "tool_call_id": "call_1", "content": [TEXT_PART]}, USER],
        [USER, {"role": "assistant", "content": None, "tool_calls": [CUSTOM_CALL]}, USER],
        [USER, {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
         {"role": "function", "name": "f", "content": None}],
        [{"role": "user", "content": [TEXT_PART, IMAGE_PART, AUDIO_PART, {"type": "file", "file": {}}]}],
        [{"role": "developer", "content": [TEXT_PART]}, {"role": "user", "content": "hi", "name": "ann"}],
    ],
    ids=["tool-result-parts", "assistant-custom-call", "function-call", "user-parts", "developer-parts"],
)  # fmt: skip
def test_messages_that_leave_out_only_what_openai_allows_go_through(proxy, fake_upstream, messages):
    answer = client(proxy).chat.completions.create(model=UPSTREAM_MODEL, messages=messages)
    assert answer.choices and fake_upstream.requests[-1].json["messages"] == messages


# ---- the real model behind the proxy ----------------------------------------------------------------


@pytest.mark.model
def test_the_local_model_refuses_a_user_message_without_content(local_proxy):
    server = local_proxy()
    c = client(server)
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user"}])  # the request
    assert_refused(refused, "messages[0].content", MISSING)
    with pytest.raises(openai.BadRequestError) as refused:
        c.responses.create(model=MODEL, input=[{"role": "user"}])
    assert_refused(refused, "input[0].content", MISSING)
    with pytest.raises(openai.BadRequestError) as refused:
        c.post("/completions", body={"model": MODEL}, cast_to=object)
    assert_refused(refused, "prompt", MISSING)
    stats = http_request("GET", server.url + "/v1/attention_store/stats").json()
    assert stats["runner"]["admitted"] == 0, stats["runner"]  # nothing reached the engine
    # What OpenAI lets a message leave out is still served: a name, content as text parts.
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "content": [{"type": "text", "text": "42."}]},
        {"role": "user", "content": [{"type": "text", "text": "And 6 times 8?"}]},
    ]
    answer = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
