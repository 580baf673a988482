"""The tool-call parsers on the text a model streams: calls out whole once their end is seen, text that
may start a call held back until it is known, content outside calls kept, a cut-off call left as text."""

from __future__ import annotations

import json

import pytest

from proxy.errors import APIError
from proxy.serving.tools import (
    ToolCallParser,
    ToolRequest,
    constrained_calls_grammar,
    detect_parser,
    forced_call_grammar,
    responses_tool_request,
    tool_request,
)


def feed_all(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    content = []
    for piece in pieces:
        content.append(parser.feed(piece).content)
    content.append(parser.finish().content)
    return "".join(content), [(c.name, json.loads(c.arguments)) for c in parser.calls]


def split(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_calls_stream_whole_and_the_text_around_them_is_content(size):
    text = (
        'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call> done'
    )
    content, calls = feed_all(ToolCallParser("hermes"), split(text, size))
    assert content == "Let me look.  done"
    assert calls == [("get_weather", {"city": "Oslo"}), ("search", {"q": "x"})]


def test_hermes_holds_back_what_may_start_a_call_and_releases_it_when_it_does_not():
    parser = ToolCallParser("hermes")
    assert parser.feed("a <tool").content == "a "  # "<tool" may be "<tool_call>"
    assert parser.feed("s are fine").content == "<tools are fine"


def test_a_cut_off_or_malformed_call_is_text():
    content, calls = feed_all(ToolCallParser("hermes"), ['<tool_call>\n{"name": "f", "argu'])
    assert calls == [] and content == '<tool_call>\n{"name": "f", "argu'


@pytest.mark.parametrize("cut", ["", "\n", "\n</tool", "\n</tool_call"])
def test_a_call_cut_off_after_its_json_is_a_call(cut):
    """max_tokens may end the answer inside the closing tag: the call's JSON is whole, so it is a call
    (vLLM's hermes parser counts an unclosed <tool_call> too), not markup shown as text."""
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Oslo"}}' + cut
    content, calls = feed_all(ToolCallParser("hermes"), split(text, 5))
    assert content == "" and calls == [("f", {"city": "Oslo"})]


def test_llama3_json_is_a_call_when_the_whole_answer_is_one():
    content, calls = feed_all(
        ToolCallParser("llama3_json"), split('<|python_tag|>{"name": "f", "parameters": {"a": 1}}')
    )
    assert content == "" and calls == [("f", {"a": 1})]
    content, calls = feed_all(ToolCallParser("llama3_json"), split("Plain text, no call."))
    assert content == "Plain text, no call." and calls == []


def test_mistral_calls_run_to_the_end_of_the_answer():
    text = 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": "y"}}]'
    content, calls = feed_all(ToolCallParser("mistral"), split(text, 4))
    assert content == "Sure. " and calls == [("a", {}), ("b", {"x": "y"})]


def test_the_format_is_detected_from_the_template():
    assert detect_parser("{{- '<tool_call>\\n' }}") == "hermes"
    assert detect_parser("[TOOL_CALLS]") == "mistral"
    assert detect_parser("<|python_tag|>") == "llama3_json"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize(
    "fmt,text",
    [
        (
            "hermes",
            'First. <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call> then '
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call> end',
        ),
        ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'),
    ],
)
def test_without_parallel_calls_an_answer_keeps_its_first_call_and_nothing_after(fmt, text, size):
    """`parallel_tool_calls: false` (max_calls=1): the first call only, in every format, and the text the
    model wrote after it is dropped, however the answer is streamed."""
    parser = ToolCallParser(fmt, max_calls=1)
    content, calls = feed_all(parser, split(text, size))
    assert calls == [("a", {"x": 1})] and parser.full
    assert content == ("First. " if fmt == "hermes" else "")
    # With parallel calls the same text holds both.
    assert len(feed_all(ToolCallParser(fmt), split(text, size))[1]) == 2


def test_without_parallel_calls_a_free_hermes_answer_stops_at_its_first_call_tag():
    """The stop that ends a free answer at its one call (the parser counts the call without the tag);
    none for a forced call (its grammar ends after one), for parallel calls, or for other formats."""
    from proxy.serving.tools import tool_request

    tool = {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}
    single = tool_request({"tools": [tool], "parallel_tool_calls": False})
    assert single is not None and single.stops("hermes") == ["</tool_call>"] and single.max_calls == 1
    assert single.stops("mistral") == []
    forced = tool_request({"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False})
    assert forced is not None and forced.stops("hermes") == []
    parallel = tool_request({"tools": [tool]})
    assert parallel is not None and parallel.stops("hermes") == [] and parallel.max_calls is None


def test_a_responses_answer_with_text_then_a_call_is_a_message_item_then_a_function_call_item():
    """The Responses stream of an answer that says something, then calls: a message item (its text
    deltas) closed when the call comes, then the call as one function_call item; the final response
    lists both, and the stored chat message holds the text the client saw and the call."""
    answer = responses_answer(tools=True)
    events = responses_events(
        answer, ["Let me ", "check.", "<tool_", 'call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>']
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[6]["text"] == "Let me check."
    call_done = events[12]
    assert call_done["output_index"] == 1 and call_done["item"]["arguments"] == '{"a": 1}'
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["id"] == call_done["item"]["id"] and final["tools"][0]["name"] == "f"
    message = answer.as_message()
    assert message["content"] == "Let me check." and message["tool_calls"][0]["function"]["name"] == "f"
    assert answer.ended_in_tool_calls()


def responses_answer(*, tools: bool, stream: bool = True):
    from proxy.openai.responses import ResponseShape
    from proxy.serving.answers import ResponsesAnswer

    request = {"tools": [{"type": "function", "name": "f"}]} if tools else {}
    shape = ResponseShape("resp_x", "m", request, None, None, True)
    return ResponsesAnswer(shape, stream=stream, tools=ToolCallParser("hermes") if tools else None)


def responses_events(answer, pieces: list[str], *, stored: list | None = None) -> list[dict]:
    """The stream's events for these deltas; `stored` gets the body the store keeps, taken (as
    write_answer does) after the answer's end and before its closing events."""
    import orjson

    from engine_api.turn import Finished, TextDelta

    done = Finished("stop", prompt_tokens=10, completion_tokens=20, reused_tokens=0)
    out = answer.opening()
    for piece in pieces:
        out += answer.add(0, TextDelta(piece))
    out += answer.end_choice(0, done)
    if stored is not None:
        stored.append(answer.body(done))
    out += answer.closing(done)
    return [orjson.loads(block.split(b"\ndata: ", 1)[1]) for block in out.split(b"\n\n") if block]


CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def test_the_newlines_between_and_after_parallel_calls_are_no_message():
    """A model writes a newline between its calls and after the last: the output is the calls alone,
    and the stored message re-renders as the model wrote it (no content)."""
    answer = responses_answer(tools=True)
    events = responses_events(answer, [CALL, "\n", CALL, "\n"])
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["function_call", "function_call"]
    assert not any(e["type"].startswith("response.output_text") for e in events)
    message = answer.as_message()
    assert message["content"] is None and len(message["tool_calls"]) == 2
    # Whitespace inside or after text is the text's own.
    text = responses_answer(tools=True)
    events = responses_events(text, ["Two", " ", "words", "\n"])
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Two words\n"
    assert text.as_message() == {"role": "assistant", "content": "Two words\n"}


@pytest.mark.parametrize("tools", [False, True], ids=["no tools", "tools"])
def test_an_empty_answer_is_one_empty_message_the_same_in_the_stream_and_the_store(tools):
    answer = responses_answer(tools=tools)
    stored: list = []
    events = responses_events(answer, [], stored=stored)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    final = events[-1]["response"]
    assert len(added) == 1 and len(final["output"]) == 1
    assert added[0]["item"]["id"] == final["output"][0]["id"] == stored[0]["output"][0]["id"]
    assert final["output"][0]["content"][0]["text"] == ""
    # Not streamed: the body the store keeps is the body the client gets.
    quiet = responses_answer(tools=tools, stream=False)
    responses_events(quiet, [])
    done = quiet.done[0]
    assert quiet.body(done)["output"] == quiet.body(done)["output"]


# -- strict tools under a free choice: the grammar (xgrammar's own string check, no model) --------------

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def strict_request(*, parallel: bool = True, api: str = "chat") -> ToolRequest:
    weather = {"name": "get_weather", "parameters": CITY, "strict": True}
    note = {"name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}
    if api == "responses":
        body = {
            "tools": [{"type": "function", **f} for f in (weather, note)],
            "parallel_tool_calls": parallel,
        }
        req = responses_tool_request(body)
    else:
        body = {
            "tools": [{"type": "function", "function": f} for f in (weather, note)],
            "parallel_tool_calls": parallel,
        }
        req = tool_request(body)
    assert req is not None
    return req


def accepts(grammar: str | None, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    assert grammar is not None
    return _is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar), text)


def hermes(call: str) -> str:
    return f"<tool_call>\n{call}\n</tool_call>"


LISBON = '{"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "C"}}'


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_strict_tools_under_auto_let_text_be_and_hold_a_call_to_its_schema(api):
    req = strict_request(api=api)
    assert req.strict == {"get_weather"}
    grammar = constrained_calls_grammar(req, "hermes")
    assert accepts(grammar, "It is sunny in Lisbon {as ever}.")
    assert accepts(grammar, "Let me check. " + hermes(LISBON))
    assert accepts(grammar, hermes(LISBON) + "\n" + hermes('{"name": "note", "arguments": {"any": [1, 2]}}'))
    assert not accepts(
        grammar, hermes('{"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "K"}}')
    )
    assert not accepts(grammar, hermes('{"name": "get_weather", "arguments": {"city": "Lisbon"}}'))
    assert not accepts(grammar, hermes('{"name": "get_time", "arguments": {}}'))
    assert not accepts(grammar, hermes('{"name": "note", "arguments": "text"}'))  # an object, strict or not
    assert not accepts(grammar, hermes(LISBON.replace(", ", ",")))  # the template's separators


def test_strict_tools_without_parallel_calls_end_the_answer_at_its_first_call():
    grammar = constrained_calls_grammar(strict_request(parallel=False), "hermes")
    assert accepts(grammar, "Checking. " + hermes(LISBON))
    assert not accepts(grammar, hermes(LISBON) + " and more")


def test_strict_mistral_calls_are_one_json_array_to_the_end_and_llama3_json_has_no_trigger():
    req = strict_request()
    grammar = constrained_calls_grammar(req, "mistral")
    two = f"[TOOL_CALLS][{LISBON}, {LISBON.replace('Lisbon', 'Porto')}]"
    assert accepts(grammar, "Checking. " + two)
    assert not accepts(grammar, two + " done")
    assert not accepts(grammar, f"[TOOL_CALLS][{LISBON.replace('C', 'K', 1)}]")
    assert not accepts(constrained_calls_grammar(strict_request(parallel=False), "mistral"), two)
    assert constrained_calls_grammar(req, "llama3_json") is None


def test_a_strict_that_is_not_a_boolean_is_a_400():
    with pytest.raises(APIError) as bad:
        tool_request({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]})
    assert bad.value.param == "tools"
    with pytest.raises(APIError) as bad:
        responses_tool_request({"tools": [{"type": "function", "name": "f", "strict": 1}]})
    assert bad.value.param == "tools[0].strict"


# -- allowed_tools: every tool rendered, the choice narrowed ----------------------------------------------


def allowed_choice(mode: str, api: str = "chat") -> ToolRequest:
    tools = [
        {"name": "get_weather", "parameters": CITY},
        {"name": "note", "parameters": {"type": "object"}},
    ]
    if api == "responses":
        choice = {
            "type": "allowed_tools",
            "mode": mode,
            "tools": [{"type": "function", "name": "get_weather"}],
        }
        req = responses_tool_request(
            {"tools": [{"type": "function", **t} for t in tools], "tool_choice": choice}
        )
    else:
        listed = [{"type": "function", "function": {"name": "get_weather"}}]
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": listed}}
        req = tool_request(
            {"tools": [{"type": "function", "function": t} for t in tools], "tool_choice": choice}
        )
    assert req is not None
    return req


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_allowed_tools_narrow_the_calls_and_keep_every_tool_rendered(api):
    free = allowed_choice("auto", api)
    assert (free.choice, free.allowed, len(free.tools)) == ("auto", {"get_weather"}, 2)
    grammar = constrained_calls_grammar(free, "hermes")
    assert accepts(grammar, "Plain text.") and accepts(grammar, "Checking. " + hermes(LISBON))
    assert not accepts(grammar, hermes('{"name": "note", "arguments": {}}'))
    forced = allowed_choice("required", api)
    call = forced_call_grammar(forced, "hermes")
    assert accepts(call, hermes(LISBON)) and not accepts(call, hermes('{"name": "note", "arguments": {}}'))


def test_a_bad_allowed_tools_choice_is_a_400():
    tools = [{"type": "function", "function": {"name": "f"}}]
    cases = [
        ({"mode": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}, "mode"),
        ({"mode": "auto", "tools": []}, "tools"),
        ({"mode": "auto", "tools": [{"type": "function", "function": {"name": "g"}}]}, "tools"),
    ]
    for spec, field in cases:
        with pytest.raises(APIError) as bad:
            tool_request({"tools": tools, "tool_choice": {"type": "allowed_tools", "allowed_tools": spec}})
        assert bad.value.param == f"tool_choice.allowed_tools.{field}"


def test_allowed_tools_under_auto_for_llama3_json_is_not_served_locally():
    import orjson

    from proxy.openai.requests import parse_chat
    from proxy.serving.options import LLAMA3_ALLOWED_AUTO, ChatSetup, unsupported_reason

    listed = [{"type": "function", "function": {"name": "f"}}]
    for mode, reason in (("auto", LLAMA3_ALLOWED_AUTO), ("required", None)):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": listed,
            "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": listed}},
        }
        req = parse_chat(orjson.dumps(body))
        assert unsupported_reason(req, ChatSetup(tools=True, parser="llama3_json")) == reason
        assert unsupported_reason(req, ChatSetup(tools=True, parser="hermes")) is None


def test_the_serving_layer_remembers_a_grammar_for_the_same_tools_and_format_only():
    """An agent sends the same tools every turn: their grammar is built once (building takes
    milliseconds on the event loop). A change of any input builds another; a refusal stays a refusal."""
    from bench.constrained import serving_for_grammars
    from proxy.openai.requests import parse_chat
    from proxy.serving.service import _tools

    serving = serving_for_grammars("m", "hermes")

    def grammar(**body):
        chat = parse_chat(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}))
        return serving._grammar(chat, _tools(chat))

    weather = strict_request().tools
    strict = grammar(tools=list(weather))
    assert strict is not None and grammar(tools=list(weather)) is strict  # remembered
    loose = [{**t, "function": {k: v for k, v in t["function"].items() if k != "strict"}} for t in weather]
    assert grammar(tools=loose) is None  # nothing to constrain without strict tools
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [weather[0]]}}
    narrowed = grammar(tools=list(weather), tool_choice=allowed)
    assert narrowed not in (None, strict)
    assert grammar(tools=list(weather), parallel_tool_calls=False) not in (None, strict, narrowed)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert grammar(response_format=fmt) is grammar(response_format=fmt)
    assert grammar(response_format=fmt) != grammar(tools=list(weather), response_format=fmt)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    for _ in range(2):
        with pytest.raises(APIError):
            grammar(response_format=bad)
    serving.prompts.pool.shutdown()
