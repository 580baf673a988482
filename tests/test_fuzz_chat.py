"""Property-based fuzzing of POST /v1/chat/completions (issue 13): random JSON shapes and types, near-valid
bodies with wrong field types, and raw bytes; every answer is a 2xx or a 4xx and the process stays up."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.http.app import build_app
from tests.servers import http_request
from tests.support.threaded_server import AppServer

URL = "/v1/chat/completions"

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model", "messages", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "stop", "seed", "session_id", "tools", "response_format", "logprobs",
]  # fmt: skip
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]), json_values)},
    optional={"content": json_values, "name": json_values},
)
near_valid = st.fixed_dictionaries(
    {
        "model": st.one_of(st.sampled_from(["gpt-fake", "local-only", ""]), json_values),
        "messages": st.one_of(st.lists(message, min_size=1, max_size=3), json_values),
    },
    optional={name: json_values for name in FIELDS[2:]},
)
bodies = st.one_of(
    near_valid.map(orjson.dumps),
    json_values.map(orjson.dumps),
    st.binary(max_size=64),
)


@pytest.fixture(scope="module")
def fuzz_proxy(fake_upstream_module):
    from proxy.settings import parse_settings

    raw = {
        "llm_endpoint": {"base_url": fake_upstream_module.url + "/v1", "model": "gpt-fake"},
        "local_runner": {"enabled": False},
        "attention_store": {"enabled": False},
        "proxy": {"host": "127.0.0.1", "port": 0, "upstream_first_byte_timeout_s": 5},
    }
    server = AppServer(build_app(parse_settings(orjson.dumps(raw), env={}, check_paths=False))).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fake_upstream_module():
    from tests.support.fake_upstream import FakeUpstream

    fake = FakeUpstream(record=False)
    server = AppServer(fake.app()).start()
    fake.url = server.url
    yield fake
    server.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, header_session=st.one_of(st.none(), st.text(max_size=8)))
def test_any_body_is_answered_with_a_2xx_or_4xx(fuzz_proxy, body, header_session):
    headers = {"Content-Type": "application/json"}
    if header_session is not None and header_session.isprintable() and header_session.isascii():
        headers["X-Session-Id"] = header_session
    r = http_request("POST", fuzz_proxy.url + URL, body, headers, timeout=30)
    assert 200 <= r.status < 500, (r.status, r.body[:300])
    if r.status >= 400:
        assert set(orjson.loads(r.body)["error"]) == {"message", "type", "param", "code"}


def test_the_proxy_is_alive_after_the_fuzzing(fuzz_proxy):
    assert http_request("GET", fuzz_proxy.url + "/healthz").status == 200


# The same with the real local model behind the proxy: near-valid bodies for the local model, answers
# kept short (max_tokens drawn small, or the small default), so every example stays cheap.
local_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "bogus"])},
        optional={"content": st.one_of(st.text(max_size=30), json_values)},
    ),
    min_size=1,
    max_size=3,
)
local_bodies = st.fixed_dictionaries(
    {"model": st.just("smollm2-135m-instruct"), "messages": local_messages},
    optional={
        "max_tokens": st.one_of(st.integers(min_value=-2, max_value=3), json_values),
        "temperature": st.one_of(st.floats(min_value=-1, max_value=3, allow_nan=False), json_values),
        "stream": st.one_of(st.booleans(), json_values),
        "stop": st.one_of(st.lists(st.text(max_size=4), max_size=5), json_values),
        "seed": json_values,
        "top_p": json_values,
        "n": json_values,
    },
).map(orjson.dumps)


@pytest.fixture
def local_fuzz_proxy(local_proxy):
    return local_proxy(local_runner={"max_tokens_default": 3})


@pytest.mark.model
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=local_bodies)
def test_any_body_for_the_local_model_is_answered_with_a_2xx_or_4xx(local_fuzz_proxy, body):
    r = http_request(
        "POST", local_fuzz_proxy.url + URL, body, {"Content-Type": "application/json"}, timeout=60
    )
    assert 200 <= r.status < 500, (r.status, r.body[:300])
    if r.status >= 400:
        assert set(orjson.loads(r.body)["error"]) == {"message", "type", "param", "code"}
    assert http_request("GET", local_fuzz_proxy.url + "/healthz").status == 200
