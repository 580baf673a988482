import pytest

from proxy.chat_request import count_turn
from proxy.errors import APIError
from proxy.headers import CACHE, TIER_NAMES, cache_label, store_headers
from proxy.session import prefix_fingerprint, resolve_session
from proxy.tenant import check_client_auth, tenant_of
from proxy.upstream import prompt_tokens_from_sse_tail, request_headers, upstream_url

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("base", "path", "want"),
    [
        ("http://h:1/v1", "/v1/chat/completions", "http://h:1/v1/chat/completions"),
        ("http://h:1/v1/", "/v1/chat/completions", "http://h:1/v1/chat/completions"),
        ("http://h:1", "/v1/chat/completions", "http://h:1/v1/chat/completions"),
        ("http://h:1/openai", "/v1/models", "http://h:1/openai/v1/models"),
        ("http://h:1/v1", "/v1/chat/completions?x=1", "http://h:1/v1/chat/completions?x=1"),
    ],
)
def test_upstream_url(base, path, want):
    assert upstream_url(base, path) == want


def test_request_headers_drop_hop_by_hop_and_replace_key():
    h = {
        "Host": "proxy",
        "Content-Length": "5",
        "Connection": "keep-alive, X-Drop",
        "X-Drop": "1",
        "Transfer-Encoding": "chunked",
        "X-Session-Id": "s",
        "Authorization": "Bearer client",
        "OpenAI-Organization": "org",
    }
    out = request_headers(h, "upstream-key")
    assert dict(out) == {"Authorization": "Bearer upstream-key", "OpenAI-Organization": "org"}
    assert request_headers(h, None)["Authorization"] == "Bearer client"


def test_resolve_session_order_and_strip():
    body = {"model": "m", "messages": MSGS, "sid": "from-body"}
    assert resolve_session(body, {"X-Session-Id": "from-header"}, "sid") == "from-body"
    assert "sid" not in body
    assert resolve_session(body, {"X-Session-Id": "from-header"}, "sid") == "from-header"
    derived = resolve_session(body, {}, "sid")
    assert derived == prefix_fingerprint("m", MSGS)
    later = MSGS + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    assert prefix_fingerprint("m", later) == derived
    assert prefix_fingerprint("other", later) != derived
    assert prefix_fingerprint("m", [{"role": "user", "content": "different"}]) != derived


@pytest.mark.parametrize("bad", [123, "", "has space", "x" * 200, "new\nline"])
def test_resolve_session_rejects_bad_ids(bad):
    with pytest.raises(APIError) as err:
        resolve_session({"session_id": bad}, {}, "session_id")
    assert err.value.status == 400 and err.value.param == "session_id"


def test_count_turn():
    assert count_turn(MSGS) == 0
    assert (
        count_turn(MSGS + [{"role": "assistant"}, {"role": "user"}, {"role": "assistant"}, {"role": "user"}])
        == 2
    )
    assert count_turn([{"role": "system"}]) == 0


def test_tenant_and_auth():
    assert tenant_of({}) == "anonymous"
    t = tenant_of({"Authorization": "Bearer secret"})
    assert len(t) == 16 and "secret" not in t and t == tenant_of({"Authorization": "bearer secret"})
    check_client_auth({}, [])
    check_client_auth({"Authorization": "Bearer a"}, ["b", "a"])
    for headers in ({}, {"Authorization": "Bearer c"}, {"Authorization": "Basic a"}):
        with pytest.raises(APIError) as err:
            check_client_auth(headers, ["a"])
        assert err.value.status == 401


def test_prompt_tokens_from_sse_tail():
    tail = b'data: {"choices":[]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":42}}\n\ndata: [DONE]\n\n'
    assert prompt_tokens_from_sse_tail(tail) == 42
    assert prompt_tokens_from_sse_tail(b"data: [DONE]\n\n") == 0


def test_cache_labels_come_from_kvtiers_tiers():
    from kvtier import TIERS

    assert [cache_label(t) for t in TIERS] == ["l0_hit", "l1_hit", "l2_hit"]
    assert cache_label("miss") == "miss" and cache_label("bypass") == "bypass"
    assert TIER_NAMES == TIERS  # the header names every tier kvtier has, in its order
    headers = store_headers(
        cache="l1",
        route="local",
        reused=32,
        session="s",
        ttft_ms=1.234,
        replica="r1",
        tiers={"l0": 16, "l1": 16},
        position_shift=0,
    )
    assert headers == {
        CACHE: "l1_hit",
        "X-AttentionStore-Route": "local",
        "X-AttentionStore-Reused-Tokens": "32",
        "X-AttentionStore-Session": "s",
        "X-AttentionStore-TTFT-Ms": "1.23",
        "X-AttentionStore-Replica": "r1",
        "X-AttentionStore-Tiers": "l0=16,l1=16,l2=0",
        "X-AttentionStore-Position-Shift": "0",
    }
    upstream = store_headers(cache="bypass", route="upstream", reused=0, session="s", ttft_ms=1, replica="r1")
    assert "X-AttentionStore-Tiers" not in upstream and upstream["X-AttentionStore-Replica"] == "r1"
