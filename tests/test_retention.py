"""OpenAI's prompt-cache fields and retention for agents (issue 38, items 2 and 4), at the proxy:
`prompt_cache_key` names the session (and goes upstream untouched), `prompt_cache_retention` is a
retention hint (400 naming the param when it is not OpenAI's), the `attention_store.retention`
settings are validated at start, and a turn that ends in tool calls retains its session in the store
(seen in /v1/attention_store/stats). The store's own rules: tests/test_kvtier_retention.py."""

from __future__ import annotations

import openai
import orjson
import pytest

from proxy.errors import APIError
from proxy.local.build import open_stores
from proxy.local_vllm.config import connector_options
from proxy.openai.requests import parse_chat, parse_responses
from proxy.serving.retention import RetentionPolicy
from proxy.settings import SettingsError, parse_settings
from proxy.turns.session import prefix_fingerprint, resolve_session
from tests.model_fixture import MODEL
from tests.servers import http_request
from tests.support.tools import SEARCH  # a tool the model calls
from tests.support.tools import TOOLS_TEMPLATE as TEMPLATE
from tests.tiny_model import tiny_loaded
from vllm_engine.link.options import ConnectorOptions

MSGS = [{"role": "user", "content": "hi"}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=120)


# ---- the session ------------------------------------------------------------------------------------


def test_prompt_cache_key_comes_after_the_session_field_and_header_and_before_the_fingerprint():
    body = {"model": "m", "messages": MSGS, "sid": "from-body", "prompt_cache_key": "from-key"}
    assert resolve_session(body, {"X-Session-Id": "from-header"}, "sid") == "from-body"
    assert resolve_session(body, {"X-Session-Id": "from-header"}, "sid") == "from-header"
    assert resolve_session(body, {}, "sid") == "from-key"
    assert body["prompt_cache_key"] == "from-key"  # OpenAI's field: it stays for the upstream
    assert resolve_session({"model": "m", "messages": MSGS, "prompt_cache_key": ""}, {}, "sid") == (
        prefix_fingerprint("m", MSGS)
    )


def test_a_prompt_cache_key_that_is_no_header_value_is_hashed_into_a_session_id():
    first = resolve_session({"prompt_cache_key": "user 42 / café"}, {}, "sid")
    assert first.startswith("pck-") and first == resolve_session(
        {"prompt_cache_key": "user 42 / café"}, {}, "sid"
    )
    assert resolve_session({"prompt_cache_key": "x" * 200}, {}, "sid").startswith("pck-")


@pytest.mark.parametrize("parse", [parse_chat, parse_responses])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_cache_key", 42),
        ("prompt_cache_key", ["a"]),
        ("prompt_cache_retention", "1h"),
        ("prompt_cache_retention", "in-memory"),
        ("prompt_cache_retention", 3600),
        ("prompt_cache_retention", ["24h"]),
    ],
)
def test_a_wrong_prompt_cache_field_is_a_400_naming_it(parse, field, value):
    body = {"model": "m", "messages": MSGS, "input": "hi", field: value}
    with pytest.raises(APIError) as err:
        parse(orjson.dumps(body))
    assert err.value.status == 400 and err.value.param == field


@pytest.mark.parametrize(("value", "hint"), [("in_memory", 600.0), ("24h", 86400.0), (None, None)])
def test_prompt_cache_retention_is_a_hint_in_seconds(value, hint):
    body = {"model": "m", "messages": MSGS, "input": "hi", "prompt_cache_retention": value}
    assert parse_chat(orjson.dumps(body)).retention_hint_s == hint
    assert parse_responses(orjson.dumps(body)).retention_hint_s == hint


def test_the_fields_go_upstream_untouched_and_a_bad_one_is_refused_before(proxy, fake_upstream):
    c = client(proxy)
    raw = c.chat.completions.with_raw_response.create(
        model="gpt-fake",
        messages=MSGS,
        extra_body={"prompt_cache_key": "conv-7", "prompt_cache_retention": "24h"},
    )
    assert raw.headers["x-attentionstore-session"] == "conv-7"
    sent = fake_upstream.requests[-1].json
    assert sent["prompt_cache_key"] == "conv-7" and sent["prompt_cache_retention"] == "24h"
    before = len(fake_upstream.requests)
    r = http_request(
        "POST",
        proxy.url + "/v1/chat/completions",
        {"model": "gpt-fake", "messages": MSGS, "prompt_cache_retention": "forever"},
    )
    assert r.status == 400 and r.json()["error"]["param"] == "prompt_cache_retention"
    assert len(fake_upstream.requests) == before


# ---- settings and the policy --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("retention", "names"),
    [
        ({"tool_call_wait_s": -1}, "tool_call_wait_s"),
        ({"max_hint_s": 0}, "max_hint_s"),
        ({"max_share": 0}, "max_share"),
        ({"max_share": 1.5}, "max_share"),
        ({"tool_call_wait_s": 120, "max_hint_s": 60}, "tool_call_wait_s"),
        ({"enabled": "yes"}, "enabled"),
        ({"ttl": 5}, "ttl"),
    ],
)
def test_bad_retention_settings_are_refused_at_start(retention, names):
    raw = orjson.dumps({"attention_store": {"retention": retention}})
    with pytest.raises(SettingsError, match=names):
        parse_settings(raw, check_paths=False, env={})


def test_retention_settings_make_the_policy():
    settings = parse_settings(
        orjson.dumps({"attention_store": {"retention": {"tool_call_wait_s": 20, "max_hint_s": 900}}}),
        check_paths=False,
        env={},
    )
    policy = RetentionPolicy.from_settings(settings)
    assert policy == RetentionPolicy(tool_call_wait_s=20, max_hint_s=900)
    assert policy.seconds(86400.0, ended_in_tool_calls=False) == 900  # a hint, capped
    assert policy.seconds(600.0, ended_in_tool_calls=True) == 600  # a hint wins over the tool wait
    assert policy.seconds(None, ended_in_tool_calls=True) == 20
    assert policy.seconds(None, ended_in_tool_calls=False) == 0
    off = parse_settings(
        orjson.dumps({"attention_store": {"retention": {"enabled": False}}}), check_paths=False, env={}
    )
    assert RetentionPolicy.from_settings(off) is None


def test_the_share_holds_may_keep_reaches_both_engines_stores(tmp_path):
    settings = parse_settings(
        orjson.dumps({"attention_store": {"retention": {"max_share": 0.6}}}), check_paths=False, env={}
    )
    stores = open_stores(settings, {MODEL: tiny_loaded()}, base_dir=tmp_path)
    try:
        assert stores[MODEL].config.retention_max_share == 0.6
    finally:
        stores[MODEL].close()
    options = ConnectorOptions.from_extra(connector_options(settings, tmp_path))
    assert options.retention_max_share == 0.6


# ---- served locally, the real model --------------------------------------------------------------------


def _stats(server) -> dict:
    r = http_request("GET", server.url + "/v1/attention_store/stats")
    assert r.status == 200
    return r.json()


def _agent_turn(c: openai.OpenAI, **extra: object) -> openai.types.chat.ChatCompletion:
    return c.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": "Find every handler in the repository."},
        ],
        tools=[SEARCH],
        tool_choice={"type": "function", "function": {"name": "search_files"}},
        temperature=0,
        max_tokens=40,
        **extra,  # type: ignore[arg-type]
    )


def test_a_conversation_hits_with_prompt_cache_key_alone_and_an_answer_in_tool_calls_retains_it(local_proxy):
    server = local_proxy(local_runner={"kv_chunk_tokens": 16, "chat_templates": {MODEL: str(TEMPLATE)}})
    c = client(server)
    history = [{"role": "user", "content": "Tell me about the sea in three sentences."}]
    first = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=history, temperature=0, max_tokens=24, extra_body={"prompt_cache_key": "conv-1"}
    )
    assert first.headers["X-AttentionStore-Session"] == "conv-1"
    history += [
        {"role": "assistant", "content": first.parse().choices[0].message.content},
        {"role": "user", "content": "And about the mountains?"},
    ]
    second = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=history, temperature=0, max_tokens=8, extra_body={"prompt_cache_key": "conv-1"}
    )
    assert second.headers["X-AttentionStore-Session"] == "conv-1"
    assert second.headers["X-AttentionStore-Cache"] in ("l0_hit", "l1_hit")
    assert second.parse().usage.prompt_tokens_details.cached_tokens > 0
    assert _stats(server)["retained_sessions"] == 0  # plain answers, no hint: nothing held

    done = _agent_turn(c, extra_body={"prompt_cache_key": "agent-1"})
    assert done.choices[0].finish_reason == "tool_calls"
    stats = _stats(server)
    assert stats["retained_sessions"] == 1 and stats["retained_bytes"]["l0"] > 0
    assert stats["retention_evictions"] == 0
    metrics = http_request("GET", server.url + "/metrics").body.decode()
    assert "attnstore_retained_sessions{" in metrics and "attnstore_retention_evictions_total{" in metrics
    # Forgetting the session (the client's: its key is its tenant) ends its hold.
    url = server.url + "/v1/attention_store/sessions/agent-1"
    assert http_request("DELETE", url, headers={"Authorization": "Bearer k"}).json()["deleted"] is True
    assert _stats(server)["retained_sessions"] == 0


def test_a_hint_retains_and_retention_off_holds_nothing(local_proxy):
    server = local_proxy(
        local_runner={"kv_chunk_tokens": 16, "chat_templates": {MODEL: str(TEMPLATE)}},
        attention_store={"retention": {"enabled": False}},
    )
    c = client(server)
    done = _agent_turn(c, extra_body={"session_id": "agent-2", "prompt_cache_retention": "24h"})
    assert done.choices[0].finish_reason == "tool_calls"
    assert _stats(server)["retained_sessions"] == 0
    # A bad hint is still refused with retention off.
    with pytest.raises(openai.BadRequestError):
        _agent_turn(c, extra_body={"prompt_cache_retention": "1h"})
