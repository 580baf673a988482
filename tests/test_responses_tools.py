"""Function tools and structured outputs on the Responses API, served locally: the official openai
client over loopback HTTP, the real model (float32) with the ChatML + Hermes template of the agents'
tests (SmolLM2's own renders no tools).

- a forced call is a `function_call` output item (call id, arguments valid for the schema), streamed
  as the documented events; its output sent back as a `function_call_output` item continues the
  conversation and reuses its KV, by `previous_response_id` or with the whole history resent;
- `text.format` json_schema / json_object answers parse and validate; a bad schema is a 400 naming it;
- hosted tools are not served locally (400 without an upstream).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.model_fixture import MODEL
from tests.support.tools import PERSON, RESPONSES_TOOLS, WEATHER
from tests.support.tools import TOOLS_TEMPLATE as TEMPLATE

pytestmark = pytest.mark.model

QUESTION = "Is it warm in Lisbon today?"
NAMED = {"type": "function", "name": "get_weather"}
# A turn that must call get_weather.
FORCED = dict(
    model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS, tool_choice=NAMED, temperature=0, max_output_tokens=60
)


@pytest.fixture
def server(local_proxy):
    return local_proxy(local_runner={"kv_chunk_tokens": 16, "chat_templates": {MODEL: str(TEMPLATE)}})


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="agent", max_retries=0, timeout=120)


def streamed(c: openai.OpenAI, **kwargs):
    """(event types in order, the final response) of a streamed Responses turn."""
    kinds, final = [], None
    with c.responses.create(**kwargs, stream=True) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    return kinds, final


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_forced_call_is_a_function_call_item_and_its_output_continues_the_conversation(server, stream):
    check_forced_call_and_its_output(client(server), stream)


def check_forced_call_and_its_output(c: openai.OpenAI, stream: bool) -> None:
    """Written once above the engines: test_vllm_engine runs it on vLLM too."""
    kwargs = FORCED
    if stream:
        kinds, first = streamed(c, **kwargs)
        assert kinds == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    else:
        first = c.responses.create(**kwargs)
    assert first.status == "completed" and len(first.output) == 1
    call = first.output[0]
    assert call.type == "function_call" and call.status == "completed" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    assert [t.name for t in first.tools] == ["get_weather", "search_files"]
    assert first.tool_choice.name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 24}'}
    raw = c.responses.with_raw_response.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=RESPONSES_TOOLS,
        temperature=0,
        max_output_tokens=16,
    )
    follow_up = raw.parse()
    assert raw.headers["X-AttentionStore-Cache"] in ("l0_hit", "l1_hit", "l2_hit")
    reused = int(raw.headers["X-AttentionStore-Reused-Tokens"])
    assert follow_up.usage.input_tokens_details.cached_tokens == reused > 0
    assert follow_up.status in ("completed", "incomplete") and follow_up.output


def test_the_whole_history_resent_as_items_renders_as_the_stored_conversation(server):
    """A stateless client sends the user's message, the output items it got and the call's output:
    the prompt is the one `previous_response_id` gives, so the greedy answers are equal."""
    c = client(server)
    first = c.responses.create(**FORCED)
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "24 C, sunny"}
    common = dict(model=MODEL, tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=12)
    chained = c.responses.create(previous_response_id=first.id, input=[result], **common)
    history = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result]
    resent = c.responses.create(input=history, **common)
    assert resent.usage.input_tokens == chained.usage.input_tokens
    assert resent.output_text == chained.output_text


def test_input_items_list_the_conversation_and_input_tokens_count_the_prompt(server):
    """GET input_items: the user's message, the call and its output (the chain's, not the
    instructions), newest first by default, paged by the SDK's cursor; ids stable from one listing and
    one response of the chain to the next. POST input_tokens: the input_tokens that turn reports."""
    c = client(server)
    first = c.responses.create(**FORCED)
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "24 C, sunny"}
    turn = dict(model=MODEL, previous_response_id=first.id, input=[result], tools=RESPONSES_TOOLS)
    counted = c.responses.input_tokens.count(**turn, instructions="Answer in one word.")
    second = c.responses.create(
        **turn, instructions="Answer in one word.", temperature=0, max_output_tokens=4
    )
    assert counted.object == "response.input_tokens" and counted.input_tokens == second.usage.input_tokens

    page = c.responses.input_items.list(second.id)
    assert [item.type for item in page.data] == ["function_call_output", "function_call", "message"]
    output, made, asked = page.data
    assert (output.call_id, output.output) == (call.call_id, "24 C, sunny")
    assert (made.call_id, made.name, made.arguments) == (call.call_id, call.name, call.arguments)
    assert asked.role == "user" and asked.content[0].text == QUESTION
    assert (page.first_id, page.last_id, page.has_more) == (output.id, asked.id, False)
    one_by_one = list(c.responses.input_items.list(second.id, order="asc", limit=1))  # 3 pages
    assert [item.id for item in one_by_one] == [asked.id, made.id, output.id]
    assert [item.id for item in c.responses.input_items.list(first.id)] == [asked.id]

    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.input_items.list(second.id, limit=101)
    assert bad.value.param == "limit"
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.input_items.list(second.id, after="msg_unknown")
    assert bad.value.param == "after"
    with pytest.raises(openai.NotFoundError):
        c.responses.input_items.list("resp_unknown")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_text_format_json_schema_answers_validate(server, stream):
    c = client(server)
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    kwargs = dict(
        model=MODEL,
        input="Describe a pilot as JSON.",
        text={"format": fmt},
        temperature=0,
        max_output_tokens=80,
    )
    answer = streamed(c, **kwargs)[1] if stream else c.responses.create(**kwargs)
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), PERSON)
    assert answer.text.format.type == "json_schema" and answer.text.format.name == "person"


def test_text_format_json_object_and_a_bad_schema(server):
    c = client(server)
    answer = c.responses.create(
        model=MODEL,
        input="Give a color and its opposite as a JSON object.",
        text={"format": {"type": "json_object"}},
        temperature=0,
        max_output_tokens=40,
    )
    assert isinstance(json.loads(answer.output_text), dict)
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.create(
            model=MODEL,
            input="hi",
            text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}},
            max_output_tokens=4,
        )
    assert bad.value.body["param"] == "text.format"
    with pytest.raises(openai.BadRequestError) as unnamed:
        c.responses.create(
            model=MODEL, input="hi", text={"format": {"type": "json_schema", "schema": PERSON}}
        )
    assert unnamed.value.body["param"] == "text.format.name"


def test_hosted_tools_and_a_tool_named_wrongly_are_refused_without_an_upstream(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as hosted:
        c.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}], max_output_tokens=4)
    assert "'web_search' are not served locally" in hosted.value.body["message"]
    with pytest.raises(openai.BadRequestError) as named:
        c.responses.create(
            model=MODEL,
            input="hi",
            tools=RESPONSES_TOOLS,
            tool_choice={"type": "function", "name": "nope"},
            max_output_tokens=4,
        )
    assert named.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as not_an_array:
        c.responses.create(model=MODEL, input="hi", max_output_tokens=4, extra_body={"tools": 5})
    assert not_an_array.value.body["param"] == "tools"


def test_an_agent_loop_on_previous_response_id_reuses_its_whole_history_every_turn(server):
    """An agent on the Responses API: a forced call, its ~300-token output sent back by
    previous_response_id alone, again. The stored conversation re-renders to the tokens the turn
    computed, so each later turn reuses the previous turn's whole prompt (to its last partial chunk of
    16 tokens, and the call's canonical tokenization: test_agents' agent loop says why)."""
    from tests.test_agents import tool_result

    c = client(server)
    previous_id, previous_input = None, 0
    new_input: list = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "Find every handler in the repository."},
    ]
    for turn in range(6):
        raw = c.responses.with_raw_response.create(
            model=MODEL,
            input=new_input,
            previous_response_id=previous_id,
            tools=RESPONSES_TOOLS,
            tool_choice={"type": "function", "name": "search_files"},
            temperature=0,
            max_output_tokens=60,
        )
        done = raw.parse()
        call = done.output[0]
        assert call.type == "function_call" and call.name == "search_files", done.output
        if turn:
            assert raw.headers["X-AttentionStore-Cache"] in ("l0_hit", "l1_hit")
            cached = done.usage.input_tokens_details.cached_tokens
            assert cached >= previous_input - 16, (turn, previous_input, done.usage)
        previous_id, previous_input = done.id, done.usage.input_tokens
        new_input = [{"type": "function_call_output", "call_id": call.call_id, "output": tool_result(turn)}]
