"""Issue 13, the proxy's part (no local model): binding, keys, timeouts, malformed requests, a misbehaving
upstream, and input fixes. Real HTTP over loopback."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import orjson
import pytest
from aiohttp import web

from proxy.cli import main as cli_main
from proxy.cluster.session_index import SESSION_INDEX, SessionRecord
from proxy.http.limits import check_bind
from proxy.settings import parse_settings
from proxy.turns.tenant import tenant_of
from tests.servers import http_request

URL = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
CLIENT, ADMIN = "client-key-1", "admin-key-1"


# ---- binding and keys ---------------------------------------------------------------------------------


def test_public_bind_without_keys_is_refused_at_start_in_one_line(tmp_path, capsys):
    path = tmp_path / "settings.json"
    path.write_bytes(
        orjson.dumps(
            {
                "attention_store": {"tiering": {"l2_disk": {"path": str(tmp_path / "kv")}}},
                "local_runner": {"enabled": False},
            }
        )
    )
    assert cli_main(["serve", "--settings", str(path), "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "proxy.api_keys" in err and "allow_unauthenticated_public_bind" in err


def test_bind_rule():
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        assert check_bind(host, [], False) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "proxy.example"):
        assert check_bind(host, [], False) is not None
        assert check_bind(host, ["k"], False) is None
        assert check_bind(host, [], True) is None


def test_keys_can_come_from_the_environment(tmp_path):
    raw = orjson.dumps({"attention_store": {"tiering": {"l2_disk": {"path": str(tmp_path / "kv")}}}})
    s = parse_settings(raw, tmp_path, env={"ATTNSTORE_API_KEYS": "a, b", "ATTNSTORE_ADMIN_KEYS": "c"})
    assert s.proxy.api_keys == ["a", "b"] and s.proxy.admin_keys == ["c"]


@pytest.fixture
def keyed(start_proxy, make_settings):
    return start_proxy(make_settings(proxy={"api_keys": [CLIENT], "admin_keys": [ADMIN]}))


def _get(server, path: str, key: str | None = None, method: str = "GET"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http_request(method, server.url + path, headers=headers)


def test_with_keys_every_endpoint_but_healthz_needs_one(keyed):
    assert _get(keyed, "/healthz").status == 200
    for path in ("/metrics", "/v1/models", "/v1/attention_store/stats"):
        r = _get(keyed, path)
        assert r.status == 401, path
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert _get(keyed, "/v1/attention_store/sessions/x", method="DELETE").status == 401


def test_metrics_and_every_tenants_stats_are_for_admin_keys_only(keyed):
    r = _get(keyed, "/metrics", CLIENT)
    assert r.status == 403 and r.json()["error"]["type"] == "permission_error"
    r = _get(keyed, "/metrics", ADMIN)
    assert r.status == 200 and b"attnstore_chat_requests" in r.body
    mine = _get(keyed, "/v1/attention_store/stats", CLIENT).json()
    assert mine["scope"] == "tenant" and mine["tenant"] == tenant_of({"Authorization": f"Bearer {CLIENT}"})
    assert "session_index" not in mine and "models" not in mine
    everyone = _get(keyed, "/v1/attention_store/stats", ADMIN).json()
    assert everyone["scope"] == "all" and "session_index" in everyone


def test_delete_of_an_unknown_session_says_not_deleted(start_proxy, make_settings):
    server = start_proxy(make_settings())
    r = _get(server, "/v1/attention_store/sessions/nobody", method="DELETE")
    assert r.status == 200 and r.json()["deleted"] is False
    record = SessionRecord(replica="r", tier="l0", chunk_keys=["k"], tokens=4)
    assert server.app is not None and server.loop is not None
    index = server.app[SESSION_INDEX]
    asyncio.run_coroutine_threadsafe(index.put("anonymous", "known", record), server.loop).result(5)
    r = _get(server, "/v1/attention_store/sessions/known", method="DELETE")
    assert r.json()["deleted"] is True
    assert _get(server, "/v1/attention_store/sessions/known", method="DELETE").json()["deleted"] is False


def test_n_of_the_wrong_type_is_a_type_error(proxy):
    r = http_request("POST", proxy.url + URL, {"model": "gpt-fake", "messages": MSGS, "n": "x"})
    assert r.status == 400
    err = r.json()["error"]
    assert err["param"] == "n" and "integer" in err["message"] and "locally" not in err["message"]


# ---- slow and idle connections, malformed requests ----------------------------------------------------


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_body_shorter_than_its_content_length_is_a_408_not_a_wait(start_proxy, make_settings):
    server = start_proxy(make_settings(proxy={"body_read_timeout_s": 0.5}))
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"model": "gpt'
        )
        reply = _read_all(sock)  # the socket's 10 s timeout fails the test if nobody answers
    assert reply.startswith(b"HTTP/1.1 408")
    assert b'"code":"request_timeout"' in reply
    assert time.monotonic() - start < 8


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"])
def test_idle_or_slow_header_connections_are_closed(start_proxy, make_settings, sent):
    server = start_proxy(make_settings(proxy={"keepalive_timeout_s": 0.5}))
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(sent)
        assert _read_all(sock) == b""  # closed by the server, without an answer
    assert time.monotonic() - start < 8


def test_malformed_requests_log_one_warning_line_each_rate_limited(proxy, caplog):
    caplog.set_level(logging.DEBUG)
    for _ in range(25):
        with _connect(proxy) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
            assert b" 400 " in _read_all(sock).split(b"\r\n", 1)[0]
    server_records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert server_records, "the bad requests were not logged at all"
    assert all(r.levelno == logging.WARNING and not r.exc_info for r in server_records)
    assert all("bad request from" in r.getMessage() for r in server_records)
    assert len(server_records) <= 10  # the rest of the window is counted, not logged
    assert _get(proxy, "/healthz").status == 200


# ---- a misbehaving upstream ---------------------------------------------------------------------------


def _bad_upstream(kind: str) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        if kind == "html":
            return web.Response(body=b"<html>login</html>", content_type="text/html")
        if kind == "hang_before_headers":
            await asyncio.sleep(3600)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": []}\n\n')
        await asyncio.sleep(3600)  # "hang_mid_stream"
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _proxy_for(start_app, start_proxy, make_settings, kind: str, **proxy):
    upstream = start_app(_bad_upstream(kind))
    settings = make_settings(llm_endpoint={"base_url": upstream.url + "/v1"}, proxy=proxy)
    return start_proxy(settings)


def test_a_streamed_request_answered_with_html_is_a_502(start_app, start_proxy, make_settings):
    server = _proxy_for(start_app, start_proxy, make_settings, "html")
    r = http_request("POST", server.url + URL, {"model": "gpt-x", "messages": MSGS, "stream": True})
    assert r.status == 502
    err = r.json()["error"]
    assert err["type"] == "upstream_error" and "text/event-stream" in err["message"]
    assert r.headers["x-attentionstore-route"] == "upstream"


def test_an_upstream_without_a_first_byte_is_a_504(start_app, start_proxy, make_settings):
    server = _proxy_for(
        start_app, start_proxy, make_settings, "hang_before_headers", upstream_first_byte_timeout_s=0.5
    )
    start = time.monotonic()
    r = http_request("POST", server.url + URL, {"model": "gpt-x", "messages": MSGS}, timeout=10)
    assert r.status == 504 and r.json()["error"]["type"] == "upstream_timeout"
    assert time.monotonic() - start < 8


def test_an_upstream_silent_mid_stream_ends_with_an_error_event(start_app, start_proxy, make_settings):
    server = _proxy_for(start_app, start_proxy, make_settings, "hang_mid_stream", upstream_idle_timeout_s=0.5)
    body = orjson.dumps({"model": "gpt-x", "messages": MSGS, "stream": True})
    with _connect(server) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 200")
    assert b'"type":"upstream_timeout"' in reply and b"[DONE]" not in reply
