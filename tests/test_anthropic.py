"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): served locally on the one
serving layer with reuse, with the official `anthropic` client over loopback HTTP and the real model
(float32, the ChatML + Hermes tools template of tests/support/tools.py); errors in Anthropic's shape, so the
SDK raises the right exception; `x-api-key` auth; upstream models passed through with the upstream's key.
"""

from __future__ import annotations

import anthropic
import jsonschema
import orjson
import pytest

from proxy.anthropic.requests import MessagesRequest, messages_fingerprint, parse_messages
from proxy.errors import APIError
from tests import test_agents as agents
from tests.model_fixture import MODEL
from tests.servers import http_request
from tests.support import tools as shared_tools

CHUNK = 16
SEARCH = {
    "name": "search_files",
    "description": "Search the repository for a text.",
    "input_schema": shared_tools.SEARCH["function"]["parameters"],
}
FORCED = {"type": "tool", "name": "search_files"}
# The 2.17 SDK's create() has no sampling parameters any more; the API (and attnstore) still takes them.
GREEDY = {"temperature": 0}


def client(server, key: str = "agent", *, x_api_key: bool = False, **kw) -> anthropic.Anthropic:
    """The SDK against the proxy; `x_api_key`: the key in x-api-key (as Claude Code sends it) instead of
    the SDK's own Authorization: Bearer."""
    if x_api_key:
        kw["default_headers"] = {**kw.get("default_headers", {}), "x-api-key": key}
    return anthropic.Anthropic(
        base_url=server.url, api_key=None if x_api_key else key, max_retries=0, timeout=120, **kw
    )


def prompt_total(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


# -- parsing and conversion (no model) ----------------------------------------------------------------


def parse(body: dict, **kw) -> MessagesRequest:
    return parse_messages(orjson.dumps({"model": "m", "max_tokens": 8, **body}), **kw)


def test_a_tool_round_trip_becomes_chat_messages_and_cache_control_the_retention_hint():
    req = parse(
        {
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "Find it."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Searching."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "search_files",
                            "input": {"query": "x"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "found"}],
                            "cache_control": {"type": "ephemeral", "ttl": "1h"},
                        },
                        {"type": "text", "text": "And now?"},
                    ],
                },
            ],
            "tools": [SEARCH],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["a", "b", "c", "d", "e"],
            "top_k": 5,
            "output_config": {
                "effort": "low",
                "format": {"type": "json_schema", "schema": {"type": "object"}},
            },
            "speed": "standard",
        }
    )
    chat = req.as_chat
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Find it."},
        {
            "role": "assistant",
            "content": "Searching.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "search_files", "arguments": '{"query": "x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "found"},
        {"role": "user", "content": "And now?"},
    ]
    assert chat.body["tool_choice"] == "required" and chat.body["parallel_tool_calls"] is False
    assert chat.body["tools"][0]["function"]["parameters"] == SEARCH["input_schema"]
    assert chat.body["top_k"] == 5 and req.stop_sequences == ["a", "b", "c", "d", "e"]
    assert chat.body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert req.retention_hint_s == 3600 and req.turn == 1 and req.unserved is None
    hi = [{"role": "user", "content": "hi"}]
    assert parse({"messages": hi}).retention_hint_s is None
    assert parse({"messages": hi, "cache_control": {"type": "ephemeral"}}).retention_hint_s == 300


def test_what_the_local_engines_cannot_serve_is_named_not_refused():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    assert "image" in (parse({"messages": [{"role": "user", "content": [image]}]}).unserved or "")
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    assert "prefill" in (parse({"messages": prefill}).unserved or "")
    bash = {"type": "bash_20250124", "name": "bash"}
    assert "server tools" in (parse({"messages": prefill[:1], "tools": [bash]}).unserved or "")
    # A tool_choice may name a server tool or want any tool: the turn is the upstream's, not a 400.
    for choice in ({"type": "tool", "name": "bash"}, {"type": "any"}, {"type": "auto"}):
        assert "server tools" in (
            parse({"messages": prefill[:1], "tools": [bash], "tool_choice": choice}).unserved or ""
        )


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
            "messages.0.content.0.input",
        ),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [SEARCH]}, "tool_choice.name"),
        ({"temperature": 1.5}, "temperature"),
        ({"system": [{"type": "image"}]}, "system.0.type"),
        (
            {"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
            "ttl",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(body, where):
    full = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(APIError) as refused:
        parse_messages(orjson.dumps({"model": "m", "max_tokens": 8, **full}))
    assert refused.value.status == 400 and where in refused.value.message


def test_the_fingerprint_ignores_moving_cache_breakpoints_and_later_turns():
    first = {"type": "text", "text": "Find it."}
    turn1 = {
        "model": "m",
        "system": "S",
        "messages": [{"role": "user", "content": [{**first, "cache_control": {"type": "ephemeral"}}]}],
    }
    turn2 = {
        "model": "m",
        "system": "S",
        "messages": [
            {"role": "user", "content": [first]},
            {"role": "assistant", "content": "ok"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "more", "cache_control": {"type": "ephemeral"}}],
            },
        ],
    }
    assert messages_fingerprint(turn1) == messages_fingerprint(turn2)
    assert messages_fingerprint(turn1) != messages_fingerprint({**turn1, "system": "other"})


# -- errors, auth and pass-through (no model) ---------------------------------------------------------


def test_errors_are_anthropics_so_the_sdk_raises_its_exceptions(start_proxy, make_settings):
    server = start_proxy(make_settings(proxy={"api_keys": ["good"]}))
    with pytest.raises(anthropic.AuthenticationError) as denied:
        client(server, "bad", x_api_key=True).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert (
        denied.value.body["type"] == "error" and denied.value.body["error"]["type"] == "authentication_error"
    )
    c = client(server, "good", x_api_key=True)  # accepted in x-api-key as in Authorization
    with pytest.raises(anthropic.BadRequestError) as bad:
        # The SDK checks max_tokens itself: sent as a raw body, the proxy's answer is what it parses.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        c.post("/v1/messages", cast_to=anthropic.types.Message, body=body)
    assert bad.value.body["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: Field required",
    }
    with pytest.raises(anthropic.NotFoundError) as unknown:
        c.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.body["error"]["type"] == "not_found_error"
    # Named as Anthropic names its answers: the header and the body's request_id, one id.
    assert unknown.value.request_id and unknown.value.request_id.startswith("req_")
    assert unknown.value.body["request_id"] == unknown.value.request_id
    with pytest.raises(anthropic.NotFoundError):
        c.messages.count_tokens(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    broken = http_request("POST", server.url + "/v1/messages", b"{not json", {"x-api-key": "good"})
    assert broken.status == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    # Other paths keep OpenAI's shape.
    chat = http_request("POST", server.url + "/v1/chat/completions", {"model": MODEL}, {"x-api-key": "good"})
    assert chat.status == 400 and "param" in chat.json()["error"]


def test_upstream_models_pass_through_with_the_upstreams_key_and_no_client_key(
    fake_upstream, start_proxy, make_settings, monkeypatch
):
    monkeypatch.setenv("ATTNSTORE_TEST_UPSTREAM_KEY", "upstream-key")
    server = start_proxy(make_settings(proxy={"api_keys": ["client-key"]}))
    c = client(server, "client-key", default_headers={"anthropic-beta": "some-beta"})
    raw = c.messages.with_raw_response.create(
        model="claude-fake",
        max_tokens=8,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"session_id": "s1"},
    )
    done = raw.parse()
    assert done.content[0].text == "Hello from the fake upstream." and done.usage.cache_read_input_tokens == 4
    assert (
        raw.headers["X-AttentionStore-Route"] == "upstream"
        and raw.headers["X-AttentionStore-Session"] == "s1"
    )
    sent = fake_upstream.requests[-1]
    # The SDK sent its key as a bearer key: the upstream's goes there and in Anthropic's x-api-key.
    assert sent.path == "/v1/messages" and sent.headers["x-api-key"] == "upstream-key"
    assert sent.headers["Authorization"] == "Bearer upstream-key"
    assert sent.headers["anthropic-version"] and sent.headers["anthropic-beta"] == "some-beta"
    assert "session_id" not in sent.json and b"client-key" not in sent.body
    assert all("client-key" not in v for v in sent.headers.values())
    counted = c.messages.count_tokens(model="claude-fake", messages=[{"role": "user", "content": "hi"}])
    assert counted.input_tokens == 11
    assert fake_upstream.requests[-1].path == "/v1/messages/count_tokens"
    assert fake_upstream.requests[-1].headers["x-api-key"] == "upstream-key"
    # A client that sends x-api-key (Claude Code): the upstream's key replaces it there only.
    client(server, "client-key", x_api_key=True).messages.create(
        model="claude-fake", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    sent = fake_upstream.requests[-1]
    assert sent.headers["x-api-key"] == "upstream-key" and "Authorization" not in sent.headers


# -- the real model -----------------------------------------------------------------------------------


@pytest.fixture
def server(local_proxy):
    return local_proxy(
        local_runner={"kv_chunk_tokens": CHUNK, "chat_templates": {MODEL: str(shared_tools.TOOLS_TEMPLATE)}}
    )


@pytest.mark.model
def test_text_answers_whole_and_streamed_are_the_same_and_reused(server):
    c = client(server)
    kwargs = dict(
        model=MODEL,
        max_tokens=12,
        extra_body=GREEDY,
        system="You are a helpful assistant.",
        messages=[{"role": "user", "content": "Name three colors."}],
        extra_headers={"X-Session-Id": "colors"},
    )
    raw = c.messages.with_raw_response.create(**kwargs)
    done = raw.parse()
    assert raw.headers["X-AttentionStore-Route"] == "local" and done.id.startswith("msg_")
    assert done._request_id and done._request_id.startswith("req_")  # the request-id header
    assert done.type == "message" and done.role == "assistant" and done.model == MODEL
    assert [b.type for b in done.content] == ["text"] and done.content[0].text
    assert done.stop_reason in ("end_turn", "max_tokens") and done.usage.output_tokens <= 12
    assert done.usage.cache_read_input_tokens == int(raw.headers["X-AttentionStore-Reused-Tokens"]) == 0
    with c.messages.stream(**kwargs) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
        headers = stream.response.headers
    assert "".join(texts) == final.content[0].text == done.content[0].text
    assert final.stop_reason == done.stop_reason and final.usage.output_tokens == done.usage.output_tokens
    # The second time the prompt is stored: read from the store, up to its last whole chunk.
    reused = int(headers["X-AttentionStore-Reused-Tokens"])
    assert final.usage.cache_read_input_tokens == reused >= prompt_total(done.usage) - CHUNK
    assert prompt_total(final.usage) == prompt_total(done.usage)
    assert done.usage.cache_creation_input_tokens >= prompt_total(done.usage) - CHUNK  # stored for reuse
    # No ttl asked: what it stored counts as a 5-minute cache write.
    assert done.usage.cache_creation is not None and done.usage.service_tier == "standard"
    assert done.usage.cache_creation.ephemeral_5m_input_tokens == done.usage.cache_creation_input_tokens
    assert done.usage.cache_creation.ephemeral_1h_input_tokens == 0


@pytest.mark.model
def test_a_stop_sequence_is_reported(server):
    """A word of the greedy answer as a stop sequence: the answer ends before it, and says so."""
    c = client(server)
    kwargs = dict(
        model=MODEL,
        max_tokens=16,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Describe the sea in one sentence."}],
    )
    text = c.messages.create(**kwargs).content[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    done = c.messages.create(**kwargs, stop_sequences=["never-said", stop])
    assert done.stop_reason == "stop_sequence" and done.stop_sequence == stop
    assert done.content[0].text == text[: text.index(stop)]


def tool_turn(c: anthropic.Anthropic, messages: list, *, stream: bool, **kw):
    """(message, headers) of one turn, whole or streamed."""
    kwargs = dict(model=MODEL, max_tokens=60, tools=[SEARCH], messages=messages, extra_body=GREEDY, **kw)
    if not stream:
        raw = c.messages.with_raw_response.create(**kwargs)
        return raw.parse(), raw.headers
    with c.messages.stream(**kwargs) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
        headers = s.response.headers
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    return final, headers


@pytest.mark.model
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_tool_round_trip_tool_use_then_result_then_answer(server, stream):
    c = client(server)
    messages: list = [{"role": "user", "content": "Find where the parser is defined."}]
    first, headers = tool_turn(c, messages, stream=stream, tool_choice=FORCED)
    assert first.stop_reason == "tool_use" and headers["X-AttentionStore-Route"] == "local"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "search_files" and call.id.startswith("toolu_") and isinstance(call.input, dict)
    assert isinstance(call.input["query"], str)
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "proxy/parser.py:12"}],
        },
    ]
    second, headers = tool_turn(c, messages, stream=stream)
    kinds = [b.type for b in second.content]
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert ("tool_use" in kinds) == (second.stop_reason == "tool_use") and kinds
    # The whole first turn (prompt and call) is reused, up to its last partial chunk.
    assert second.usage.cache_read_input_tokens >= prompt_total(first.usage) - CHUNK
    assert headers["X-AttentionStore-Cache"] in ("l0_hit", "l1_hit")


@pytest.mark.model
def test_a_strict_tools_input_follows_its_schema(server):
    """Strict tool use: the prompt has the model copy a call whose unit is outside the enum; without
    `strict` the tool_use input breaks the schema, with it the input follows it."""
    weather = shared_tools.WEATHER["function"]
    tool = {
        "name": weather["name"],
        "description": weather["description"],
        "input_schema": weather["parameters"],
    }
    messages = [{"role": "user", "content": "Repeat exactly, with nothing else: " + agents.OUT_OF_SCHEMA}]
    for tools, valid in (([tool], False), ([{**tool, "strict": True}], True)):
        msg = client(server).messages.create(
            model=MODEL, max_tokens=40, tools=tools, messages=messages, extra_body=GREEDY
        )
        (use,) = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use"
        assert jsonschema.Draft202012Validator(weather["parameters"]).is_valid(use.input) is valid, use.input
    with pytest.raises(anthropic.BadRequestError) as bad:
        client(server).messages.create(
            model=MODEL, max_tokens=4, tools=[{**tool, "strict": "yes"}], messages=messages
        )
    assert "tools.0.strict" in str(bad.value)


def test_count_tokens_equals_the_turns_prompt(server):
    c = client(server)
    kwargs = dict(
        model=MODEL,
        system="You are a coding agent.",
        tools=[SEARCH],
        messages=[{"role": "user", "content": "Find every handler."}],
    )
    counted = c.messages.count_tokens(**kwargs)
    done = c.messages.create(**kwargs, max_tokens=40, extra_body=GREEDY, tool_choice=FORCED)
    assert counted.input_tokens == prompt_total(done.usage) > 0
    plain = c.messages.count_tokens(model=MODEL, messages=kwargs["messages"])
    assert plain.input_tokens < counted.input_tokens  # the tools are rendered into the prompt


@pytest.mark.model
def test_a_cache_control_hint_and_a_tool_use_answer_retain_the_session(server):
    """The retention seam: cache_control's ttl is the turn's hint, and an answer ending in tool_use
    holds its session through the tool's wait; a plain answer without a hint holds nothing."""

    def retained() -> int:
        return http_request("GET", server.url + "/v1/attention_store/stats").json()["retained_sessions"]

    c = client(server)
    hi = {"type": "text", "text": "Hi"}
    c.messages.create(
        model=MODEL, max_tokens=4, extra_body=GREEDY, messages=[{"role": "user", "content": [hi]}]
    )
    assert retained() == 0
    hinted = {**hi, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    hour = c.messages.create(
        model=MODEL,
        max_tokens=4,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": [hinted]}],
        extra_headers={"X-Session-Id": "hinted"},
    )
    assert retained() == 1
    assert hour.usage.cache_creation is not None  # stored under a 1h ttl: an hour's cache write
    assert hour.usage.cache_creation.ephemeral_1h_input_tokens == hour.usage.cache_creation_input_tokens
    assert hour.usage.cache_creation.ephemeral_5m_input_tokens == 0
    done, _ = tool_turn(
        c,
        [{"role": "user", "content": "Find the parser."}],
        stream=False,
        tool_choice=FORCED,
        extra_headers={"X-Session-Id": "agent"},
    )
    assert done.stop_reason == "tool_use" and retained() == 2


def system_prompt() -> str:
    """A Claude-Code-like system prompt of about a thousand tokens."""
    rules = [
        f"Rule {i}: when editing module_{i}.py keep functions short, name things plainly, and test "
        f"the behaviour that could break (case {i})."
        for i in range(29)
    ]
    return "You are a coding agent working in a repository.\n" + "\n".join(rules)


@pytest.mark.model
def test_a_twenty_turn_agent_loop_reads_most_of_every_prompt_from_the_store(server):
    """Claude Code's shape: a long system prompt, tools, a forced call each turn and its result of a
    few hundred tokens, cache breakpoints on the system prompt and the latest message, no session id
    (the fingerprint names the session). From the third turn on the store gives most of the prompt."""
    c = client(server)
    system = [{"type": "text", "text": system_prompt(), "cache_control": {"type": "ephemeral"}}]
    messages: list = [{"role": "user", "content": [{"type": "text", "text": "Find every handler."}]}]
    shares, sessions, previous = [], set(), 0
    for turn in range(20):
        # The breakpoint moves to the latest message, as Claude Code moves it.
        last = messages[-1]["content"][-1]
        last["cache_control"] = {"type": "ephemeral"}
        raw = c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=48,
            extra_body=GREEDY,
            system=system,
            tools=[SEARCH],
            tool_choice=FORCED,
            messages=messages,
        )
        done = raw.parse()
        del last["cache_control"]
        sessions.add(raw.headers["X-AttentionStore-Session"])
        assert done.stop_reason == "tool_use", done.content
        total = prompt_total(done.usage)
        assert done.usage.cache_read_input_tokens == int(raw.headers["X-AttentionStore-Reused-Tokens"])
        if turn:
            assert done.usage.cache_read_input_tokens >= previous - CHUNK, (turn, previous, done.usage)
        shares.append(done.usage.cache_read_input_tokens / total)
        previous = total
        (call,) = [b for b in done.content if b.type == "tool_use"]
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in done.content]}
        )
        result = "\n".join(agents.tool_result(turn).splitlines()[:8])  # about 200 tokens
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}
        )
    assert len(sessions) == 1 and next(iter(sessions)).startswith("fp-")
    print("cache_read share per turn:", [round(s, 3) for s in shares])
    assert min(shares[2:]) >= 0.85, shares
