"""Agents on the local model (issue 27): tools, structured outputs and logprobs served locally, with the
official openai client over loopback HTTP and the real model (float32).

SmolLM2's own chat template renders no tools, so these tests give it a ChatML template with Hermes
`<tool_call>` blocks (tests/templates/chatml_tools.jinja, as Qwen2.5's) through
`local_runner.chat_templates`; the parser (hermes) is detected from it.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.model_fixture import MODEL
from tests.servers import http_request
from tests.support.tools import PERSON, TOOLS, WEATHER
from tests.support.tools import TOOLS_TEMPLATE as TEMPLATE

pytestmark = pytest.mark.model


@pytest.fixture
def server(local_proxy):
    return local_proxy(local_runner={"kv_chunk_tokens": 16, "chat_templates": {MODEL: str(TEMPLATE)}})


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="agent", max_retries=0, timeout=120)


def streamed_calls(stream) -> tuple[str, list[dict], str | None]:
    """(content, tool calls, finish reason) accumulated from chunks as the openai client's users do."""
    content, calls, reason = [], {}, None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += call.id or ""
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            reason = choice.finish_reason or reason
    return "".join(content), [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_named_tool_choice_returns_a_valid_call_of_that_function(server, stream):
    check_named_tool_choice(client(server), stream)


def check_named_tool_choice(c: openai.OpenAI, stream: bool) -> None:
    messages = [{"role": "user", "content": "Is it warm in Lisbon today?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=60
    )
    if stream:
        raw = c.chat.completions.with_raw_response.create(**kwargs, stream=True)
        _, calls, reason = streamed_calls(raw.parse())
    else:
        raw = c.chat.completions.with_raw_response.create(**kwargs)
        done = raw.parse()
        reason = done.choices[0].finish_reason
        calls = [
            {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
            for t in done.choices[0].message.tool_calls or []
        ]
    assert raw.headers["X-AttentionStore-Route"] == "local"
    assert reason == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_required_always_returns_a_call(server):
    check_required(client(server))


def check_required(c: openai.OpenAI) -> None:
    for question in ("Hello!", "Find where the parser is defined.", "What is 2 + 2?"):
        done = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            max_tokens=60,
        )
        calls = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "tool_calls" and calls
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])


# A call the model copies from its prompt whose unit is outside get_weather's enum.
OUT_OF_SCHEMA = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "K"}}\n</tool_call>'
)


def strict(tools: list[dict]) -> list[dict]:
    return [{**t, "function": {**t["function"], "strict": True}} for t in tools]


def test_strict_tools_under_auto_hold_a_call_to_its_schema(server):
    """OpenAI's strict function calling with a free choice: the same answer without `strict` is a call
    whose arguments break the schema; with it, the call follows the schema."""
    check_strict_tools(client(server))


def check_strict_tools(c: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Repeat exactly, with nothing else: " + OUT_OF_SCHEMA}]
    schema = WEATHER["function"]["parameters"]
    for tools, valid in ((TOOLS, False), (strict(TOOLS), True)):
        answer = c.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=40
        )
        (call,) = answer.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and answer.choices[0].finish_reason == "tool_calls"
        arguments = json.loads(call.function.arguments)
        assert jsonschema.Draft202012Validator(schema).is_valid(arguments) is valid, arguments


def test_allowed_tools_narrow_the_choice_with_the_same_prompt(server):
    """tool_choice allowed_tools: every tool is still rendered (the prompt, and so its KV, is the one
    without the choice), and calls name only the allowed functions: required, a call of the one allowed;
    auto, the copied get_weather call becomes a call of the allowed function."""
    c = client(server)
    messages = [{"role": "user", "content": "Repeat exactly, with nothing else: " + OUT_OF_SCHEMA}]
    only = [{"type": "function", "function": {"name": "search_files"}}]
    plain = c.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=40
    )
    assert [t.function.name for t in plain.choices[0].message.tool_calls] == ["get_weather"]
    for mode in ("required", "auto"):
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": only}}
        answer = c.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=160
        )
        assert answer.usage.prompt_tokens == plain.usage.prompt_tokens
        calls = answer.choices[0].message.tool_calls or []
        assert [t.function.name for t in calls] == ["search_files"], (mode, answer.choices[0].message)


def test_tools_with_a_response_format_answer_with_a_call_or_the_format(server):
    """`tool_choice: auto` with response_format: a call is still possible (the grammar is a call or the
    format's JSON, as OpenAI's models may do either). On this prompt the greedy answer is a call (under
    the format's grammar alone it could only be JSON); on a prompt it answers, the JSON parses."""
    check_call_or_format(client(server), expect_call=True)


def check_call_or_format(c: openai.OpenAI, *, expect_call: bool) -> None:
    """`expect_call`: the weather question's greedy answer must be a call (the embedded engine's, on
    these weights); else a call or JSON in the format (another engine's kernels may choose either)."""
    asked = dict(model=MODEL, tools=TOOLS, temperature=0, max_tokens=60)
    fmt = {"type": "json_object"}
    weather = [{"role": "user", "content": "What's the weather in Oslo?"}]
    done = c.chat.completions.create(messages=weather, response_format=fmt, **asked)
    calls = done.choices[0].message.tool_calls
    if calls or expect_call:
        assert done.choices[0].finish_reason == "tool_calls" and calls
        assert calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    else:
        assert isinstance(json.loads(done.choices[0].message.content or ""), dict)
    person = [{"role": "user", "content": "Describe a pilot as JSON with a name and an age."}]
    fmt_schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answer = c.chat.completions.create(messages=person, response_format=fmt_schema, **asked).choices[0]
    if answer.message.tool_calls:
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        call = answer.message.tool_calls[0].function
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    else:
        jsonschema.validate(json.loads(answer.message.content), PERSON)


SUBJECTS = [
    "a pilot",
    "a baker",
    "a child",
    "a painter",
    "a doctor",
    "a farmer",
    "a poet",
    "a sailor",
    "a teacher",
    "a chef",
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_json_schema_answers_validate_on_every_prompt(server, stream):
    """Eight prompts, half answered whole and half streamed."""
    check_json_schema(client(server), stream, SUBJECTS[4:] if stream else SUBJECTS[:4])


def check_json_schema(c: openai.OpenAI, stream: bool, subjects: list[str]) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    valid = 0
    for subject in subjects:
        kwargs = dict(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe {subject} as JSON."}],
            response_format=fmt,
            temperature=0,
            max_tokens=64,
        )
        if stream:
            text = "".join(
                chunk.choices[0].delta.content or ""
                for chunk in c.chat.completions.create(**kwargs, stream=True)
                if chunk.choices
            )
        else:
            text = c.chat.completions.create(**kwargs).choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)
        valid += 1
    assert valid == len(subjects)


def test_json_object_and_an_invalid_schema(server):
    check_json_object_and_an_invalid_schema(client(server))


def check_json_object_and_an_invalid_schema(c: openai.OpenAI) -> None:
    done = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with a JSON object: the key color, the value red."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=100,
    )
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].message.content), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format=bad
        )
    assert refused.value.body["param"] == "response_format"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_ignore_eos_decodes_to_a_grammars_end_and_no_further(server, stream):
    """vLLM's `ignore_eos` with a grammar: the answer ends where the grammar does (before, the job
    failed with a 500 once the grammar had taken the end of text)."""
    check_ignore_eos_under_a_grammar(client(server), stream)


def check_ignore_eos_under_a_grammar(c: openai.OpenAI, stream: bool) -> None:
    small = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": small}}
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with one key a."}],
        response_format=fmt,
        max_tokens=60,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    if stream:
        chunks = [ch for ch in c.chat.completions.create(stream=True, **kwargs) if ch.choices]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        answer = c.chat.completions.create(**kwargs)
        text, finish = answer.choices[0].message.content, answer.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), small)
    named = {"type": "function", "function": {"name": "get_weather"}}
    called = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=TOOLS,
        tool_choice=named,
        max_tokens=60,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert called.choices[0].finish_reason == "tool_calls" and called.choices[0].message.tool_calls


def test_top_logprobs_give_five_alternatives_with_the_chosen_token_first(server):
    check_top_logprobs(client(server))


def check_top_logprobs(c: openai.OpenAI) -> None:
    done = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colors."}],
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=5,
    )
    entries = done.choices[0].logprobs.content
    assert len(entries) == done.usage.completion_tokens
    assert "".join(e.token for e in entries) == done.choices[0].message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.logprob <= 0 and [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )


def test_logit_bias_steers_the_answer_and_a_bad_one_is_refused(server, smollm):
    c = client(server)
    messages = [{"role": "user", "content": "Name three colors."}]
    (banana,) = smollm.tokenizer.encode(" banana", add_special_tokens=False)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=3, logit_bias={str(banana): 100}
    )
    assert raw.headers["X-AttentionStore-Route"] == "local"
    assert raw.parse().choices[0].message.content.startswith(" banana banana")
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model=MODEL, messages=messages, logit_bias={"99999999": 5})
    assert refused.value.body["param"] == "logit_bias"


def tool_result(turn: int) -> str:
    """A tool's output of a few hundred tokens, different each turn."""
    rows = [
        f"file src/module_{turn}_{i}.py line {10 * i}: def handler_{i}(request): return {i}"
        for i in range(12)
    ]
    return "\n".join(rows)


def test_a_ten_turn_agent_loop_reuses_its_whole_history_every_turn(server):
    check_agent_loop(client(server), turns=10, chunk=16)


def check_agent_loop(c: openai.OpenAI, *, turns: int, chunk: int) -> None:
    """An agent's turns: a forced call, its ~300-token result appended, again; every later turn an
    l0/l1 hit that reuses its whole history up to the last partial KV chunk (`chunk` tokens)."""
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "Find every handler in the repository."},
    ]
    ratios, previous = [], 0
    for turn in range(turns):
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "search_files"}},
            temperature=0,
            max_tokens=60,
            extra_body={"session_id": "agent-loop"},
        )
        done = raw.parse()
        assert done.choices[0].finish_reason == "tool_calls", done.choices[0].message.content
        call = done.choices[0].message.tool_calls[0]
        usage = done.usage
        if turn:
            assert raw.headers["X-AttentionStore-Cache"] in ("l0_hit", "l1_hit")
            # The whole history is reused, up to the call the model answered with: re-rendered, the call
            # is the same text, but tokenized canonically it may differ from the ids it was generated
            # as (' {' '"' against ' {"'), and reuse runs to the first difference.
            assert usage.prompt_tokens_details.cached_tokens >= previous - chunk, (turn, previous, usage)
            ratios.append(usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens)
        previous = usage.prompt_tokens
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call.id, "content": tool_result(turn)})
    # Each turn adds a tool result of ~300 tokens: from the fifth turn on the history is most of it.
    assert min(ratios[4:]) >= 0.8, ratios


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_n_answers_share_one_prefill_and_equal_each_other_at_temperature_0(server, stream):
    """n: 3 at temperature 0 gives 3 equal answers, each with its index; the prompt is computed once
    (the other two copy its KV: the runner's forked_tokens) and the usage counts every answer."""
    check_n_answers(client(server), server.url, stream)


def check_n_answers(c: openai.OpenAI, url: str, stream: bool, *, forks: bool = True) -> None:
    """`forks`: the engine copies the first answer's prompt KV (the embedded one does; vLLM computes or
    reuses each answer's prompt itself)."""
    before = http_request("GET", url + "/v1/attention_store/stats").json()["runner"]["forked_tokens"]
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], temperature=0, max_tokens=8, n=3
    )
    if stream:
        texts = ["", "", ""]
        reasons: list[str | None] = [None, None, None]
        usage = None
        for chunk in c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        assert all(reasons)
    else:
        done = c.chat.completions.create(**kwargs)
        assert [ch.index for ch in done.choices] == [0, 1, 2]
        texts, usage = [ch.message.content for ch in done.choices], done.usage
    assert texts[0] and texts == [texts[0]] * 3
    # Three equal answers of equal length: the usage counts every one of them.
    assert usage is not None and usage.completion_tokens >= 3 and usage.completion_tokens % 3 == 0
    forked = http_request("GET", url + "/v1/attention_store/stats").json()["runner"]["forked_tokens"]
    assert forked - before == (2 * (usage.prompt_tokens - 1) if forks else 0)  # two copied the first's
