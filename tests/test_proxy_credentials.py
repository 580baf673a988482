"""One header filter for every call the proxy makes for a client (chat, /v1/models, a forwarded turn): when
the proxy authenticates clients (api or admin keys), no client credential reaches the upstream; when it does
not, the client's own key does, unless `llm_endpoint.api_key_env` supplies one. Real HTTP, the fake
upstream recording what it receives. (A turn forwarded to another replica keeps the key, which that
replica checks: test_forwarding.py.)"""

from __future__ import annotations

import pytest

from tests.servers import http_request

KEY = "client-or-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "gpt-fake", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "keys",
    [
        {},  # the proxy does not authenticate clients
        {"api_keys": [KEY]},
        {"admin_keys": [KEY]},  # admin keys only: the case /v1/models once passed on
        {"api_keys": ["another"], "admin_keys": [KEY]},
    ],
    ids=["no-keys", "api-key", "admin-key-only", "admin-key"],
)
@pytest.mark.parametrize("upstream_key", [None, "sk-upstream"], ids=["no-upstream-key", "upstream-key"])
def test_what_authorization_reaches_the_upstream_on_every_route(
    fake_upstream, start_proxy, make_settings, monkeypatch, keys, upstream_key
):
    if upstream_key:
        monkeypatch.setenv("ATTNSTORE_TEST_UPSTREAM_KEY", upstream_key)
    server = start_proxy(make_settings(proxy=keys))
    assert http_request("POST", server.url + "/v1/chat/completions", CHAT, AUTH).status == 200
    models = http_request("GET", server.url + "/v1/models", None, AUTH)
    assert models.status == 200 and [m["id"] for m in models.json()["data"]] == ["gpt-fake"]

    # The upstream's own key when one is configured; else the client's, unless it is a key of this proxy.
    expected = f"Bearer {upstream_key}" if upstream_key else (None if keys else AUTH["Authorization"])
    sent = {(r.method, r.path): r.headers for r in fake_upstream.requests}
    assert set(sent) == {("POST", "/v1/chat/completions"), ("GET", "/v1/models")}
    for route, headers in sent.items():
        assert headers.get("Authorization") == expected, route
        if keys:
            assert not any(KEY in value for value in headers.values()), route
