"""GET /v1/models and GET /healthz."""

from tests.servers import http_request


def ids(r):
    assert r.status == 200
    doc = r.json()
    assert doc["object"] == "list"
    return [m["id"] for m in doc["data"]]


def test_models_merges_local_and_upstream(fake_upstream, start_proxy, make_settings):
    settings = make_settings(local_runner={"enabled": True, "models": {"local-a": "/x.gguf"}})
    server = start_proxy(settings)
    fake_upstream.models = ["gpt-fake", "local-a", "gpt-other"]
    r = http_request("GET", server.url + "/v1/models", headers={"Authorization": "Bearer ck"})
    assert ids(r) == ["local-a", "gpt-fake", "gpt-other"]
    assert r.json()["data"][0]["owned_by"] == "attnstore"
    assert fake_upstream.requests[-1].path == "/v1/models"


def test_models_without_local_runner(proxy, fake_upstream):
    assert ids(http_request("GET", proxy.url + "/v1/models")) == ["gpt-fake"]


def test_models_upstream_slow_or_down(fake_upstream, start_proxy, make_settings):
    settings = make_settings(
        local_runner={"enabled": True, "models": {"local-a": "/x.gguf"}}, proxy={"models_timeout_s": 0.3}
    )
    server = start_proxy(settings)
    fake_upstream.models_delay_s = 2
    assert ids(http_request("GET", server.url + "/v1/models")) == ["local-a"]
    down = start_proxy(
        make_settings(
            local_runner={"enabled": True, "models": {"local-a": "/x.gguf"}},
            llm_endpoint={"base_url": "http://127.0.0.1:9/v1"},
        )
    )
    assert ids(http_request("GET", down.url + "/v1/models")) == ["local-a"]


def test_healthz(fake_upstream, start_proxy, make_settings):
    server = start_proxy(make_settings(proxy={"replica_id": "r1"}))
    r = http_request("GET", server.url + "/healthz")
    assert r.status == 200
    doc = r.json()
    assert doc["status"] == "ok" and doc["replica"] == "r1" and doc["upstream"] == fake_upstream.url + "/v1"


def test_healthz_without_upstream(start_proxy):
    doc = http_request("GET", start_proxy().url + "/healthz").json()
    assert doc["upstream"] is None and doc["status"] == "ok"
