"""Bad input is a 4xx OpenAI error naming the param; a handler crash is a 500 and the proxy keeps going."""

import time

import orjson
import pytest
from aiohttp import web

from proxy.turns.backend import LocalBackend
from tests.servers import http_request

URL = "/v1/chat/completions"
OK = {"model": "gpt-fake", "messages": [{"role": "user", "content": "hi"}]}


def assert_error(r, status, param=None):
    assert r.status == status, r.body
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'"text"', None),
        ({"messages": OK["messages"]}, "model"),
        ({**OK, "model": ""}, "model"),
        ({**OK, "model": 7}, "model"),
        ({"model": "gpt-fake"}, "messages"),
        ({**OK, "messages": []}, "messages"),
        ({**OK, "messages": "hi"}, "messages"),
        ({**OK, "messages": ["hi"]}, "messages[0]"),
        ({**OK, "messages": [{"content": "no role"}]}, "messages[0].role"),
        ({**OK, "messages": [{"role": 1}]}, "messages[0].role"),
        ({**OK, "stream": "yes"}, "stream"),
        ({**OK, "stream_options": 3}, "stream_options"),
        ({**OK, "stream_options": {"include_usage": True}}, "stream_options"),  # without stream: OpenAI's 400
        ({**OK, "session_id": 12}, "session_id"),
    ],
)
def test_bad_input_is_400(proxy, fake_upstream, body, param):
    r = http_request("POST", proxy.url + URL, body, headers={"Content-Type": "application/json"})
    assert_error(r, 400, param)
    assert fake_upstream.requests == []


def test_oversized_body_is_413(fake_upstream, start_proxy, make_settings):
    server = start_proxy(make_settings(proxy={"max_body_mb": 0.01}))
    big = {**OK, "messages": [{"role": "user", "content": "x" * 20_000}]}
    assert_error(http_request("POST", server.url + URL, big), 413)
    assert http_request("POST", server.url + URL, OK).status == 200


def test_unknown_path_and_method_are_json(proxy):
    assert_error(http_request("GET", proxy.url + "/v1/nope"), 404)
    assert_error(http_request("GET", proxy.url + URL), 405)


def test_client_auth(fake_upstream, start_proxy, make_settings):
    server = start_proxy(make_settings(proxy={"api_keys": ["good-key"]}))
    err = assert_error(http_request("POST", server.url + URL, OK), 401)
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")  # OpenAI's
    assert_error(http_request("POST", server.url + URL, OK, {"Authorization": "Bearer bad"}), 401)
    assert_error(http_request("GET", server.url + "/v1/models", None, {"Authorization": "Bearer bad"}), 401)
    assert http_request("POST", server.url + URL, OK, {"Authorization": "Bearer good-key"}).status == 200
    # The proxy's own key authenticates the client here; it is never passed on to the upstream.
    assert "Authorization" not in fake_upstream.requests[-1].headers
    assert http_request("GET", server.url + "/healthz").status == 200


class FakeLocal(LocalBackend):
    """A local backend through the seam: serves "local-model" unless `temperature` is set; its turns
    reuse `reused` of their 10 prompt tokens from L1 (a miss when 0), reported through the turn."""

    def __init__(self, reused: int = 0):
        self.seen = []
        self.reused = reused

    def supports(self, chat):
        return "temperature is not supported locally" if "temperature" in chat.body else None

    async def handle(self, request, chat, turn):
        self.seen.append((chat.model, turn))
        if chat.body.get("boom"):
            raise RuntimeError("local backend exploded")
        turn.local_first_token(
            cache="l1" if self.reused else "miss",
            reused=self.reused,
            prompt=10,
            tiers={"l1": self.reused},
            position_shift=0,
            at=time.monotonic(),
        )
        return web.json_response({"ok": True}, headers=turn.headers())


def local_settings(make_settings):
    return make_settings(local_runner={"enabled": True, "models": {"local-model": "/nowhere.gguf"}})


def test_local_route_through_the_seam(fake_upstream, start_proxy, make_settings):
    backend = FakeLocal()
    server = start_proxy(local_settings(make_settings), local_backend=backend)
    body = {**OK, "model": "local-model", "session_id": "s-1"}
    r = http_request("POST", server.url + URL, body, {"Authorization": "Bearer t"})
    assert r.status == 200 and r.headers["x-attentionstore-route"] == "local"
    model, turn = backend.seen[-1]
    assert model == "local-model" and turn.session == "s-1" and turn.turn == 0 and turn.tenant != "anonymous"
    assert fake_upstream.requests == []
    # Unsupported options and other models go upstream.
    r = http_request("POST", server.url + URL, {**body, "temperature": 0.5})
    assert r.headers["x-attentionstore-route"] == "upstream"
    assert fake_upstream.requests[-1].json["model"] == "local-model"


def test_handler_crash_is_500_and_proxy_survives(fake_upstream, start_proxy, make_settings, caplog):
    server = start_proxy(local_settings(make_settings), local_backend=FakeLocal())
    r = http_request("POST", server.url + URL, {**OK, "model": "local-model", "boom": True})
    err = assert_error(r, 500)
    assert err["type"] == "server_error" and "exploded" not in err["message"]
    assert any("local backend exploded" in (r.exc_text or "") for r in caplog.records)
    assert http_request("POST", server.url + URL, {**OK, "model": "local-model"}).status == 200


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        orjson.dumps({"model": "m", "messages": []}),
        orjson.dumps({"messages": [{"role": "user"}]}),
    ],
)
def test_an_error_answer_carries_the_attentionstore_headers_too(proxy, body):
    r = http_request("POST", proxy.url + "/v1/chat/completions", body, {"X-Session-Id": "s-err"})
    assert r.status == 400
    assert (
        r.headers["x-attentionstore-cache"] == "bypass" and r.headers["x-attentionstore-route"] == "upstream"
    )
    assert (
        r.headers["x-attentionstore-reused-tokens"] == "0"
        and r.headers["x-attentionstore-session"] == "s-err"
    )
    assert float(r.headers["x-attentionstore-ttft-ms"]) >= 0 and r.headers["x-attentionstore-replica"]
