"""Every answer of the chat endpoint finishes through one `Turn`: its X-AttentionStore-* headers, its one log
line and its metrics observation, for a local turn (a stand-in through the seam), an upstream turn, a
refused turn, an error, and a local turn whose client went away. Real HTTP over loopback; the real model's
turns are checked the same way in test_reuse.py and test_local_route.py."""

from __future__ import annotations

import asyncio
import logging
import re
import threading

import aiohttp
import pytest
from aiohttp import web

from proxy.errors import APIError
from proxy.turns.backend import LocalBackend
from tests.servers import http_request
from tests.support.waiting import wait_until
from tests.test_proxy_input import FakeLocal

URL = "/v1/chat/completions"
LOCAL = {"model": "local-model", "messages": [{"role": "user", "content": "hi"}]}
UPSTREAM = {
    "model": "gpt-fake",
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ],
}


@pytest.fixture
def log_lines(caplog):
    """lines(session) -> the [AttentionStore] lines of that session, once there is at least one."""
    caplog.set_level(logging.INFO, logger="attnstore")

    def lines(session: str) -> list[str]:
        def found() -> list[str]:
            prefix = f"[AttentionStore] session={session} "
            return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]

        wait_until(found, f"the log line of session {session!r}", timeout=10)
        return found()

    return lines


def metric(server, name: str, key: str | None = None) -> float:
    """One sample of /metrics (0 when absent), labels as Prometheus prints them."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = http_request("GET", server.url + "/metrics", headers=headers).body.decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def store_headers_of(r) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.startswith("x-attentionstore-")}


def local_proxy_with(start_proxy, make_settings, backend: LocalBackend, **proxy):
    settings = make_settings(
        local_runner={"enabled": True, "models": {"local-model": "/nowhere.gguf"}},
        proxy={"replica_id": "r1", **proxy},
    )
    return start_proxy(settings, local_backend=backend)


def test_a_local_turn(start_proxy, make_settings, log_lines):
    server = local_proxy_with(start_proxy, make_settings, FakeLocal(reused=4))
    r = http_request("POST", server.url + URL, {**LOCAL, "session_id": "s-local"})
    assert r.status == 200
    headers = store_headers_of(r)
    assert float(headers.pop("x-attentionstore-ttft-ms")) >= 0
    assert headers == {
        "x-attentionstore-cache": "l1_hit",
        "x-attentionstore-route": "local",
        "x-attentionstore-reused-tokens": "4",
        "x-attentionstore-session": "s-local",
        "x-attentionstore-replica": "r1",
        "x-attentionstore-tiers": "l0=0,l1=4,l2=0",
        "x-attentionstore-position-shift": "0",
        "x-attentionstore-skipped-tokens": "0",  # nothing stored was recomputed
    }
    [line] = log_lines("s-local")
    assert line.startswith("[AttentionStore] session=s-local turn=0 l1_hit reused=4 prompt=10 ttft_ms=")
    assert metric(server, 'attnstore_chat_requests_total{cache="l1_hit",route="local"}') == 1
    assert metric(server, 'attnstore_ttft_seconds_count{cache="l1_hit"}') == 1
    assert metric(server, "attnstore_reused_tokens_total") == 4
    assert metric(server, "attnstore_prefilled_tokens_total") == 6


def test_an_upstream_turn(proxy, log_lines):
    r = http_request("POST", proxy.url + URL, UPSTREAM, {"X-Session-Id": "s-up"})
    assert r.status == 200
    headers = store_headers_of(r)
    assert headers["x-attentionstore-cache"] == "bypass" and headers["x-attentionstore-route"] == "upstream"
    assert headers["x-attentionstore-reused-tokens"] == "0" and headers["x-attentionstore-session"] == "s-up"
    assert "x-attentionstore-tiers" not in headers  # local turns only
    [line] = log_lines("s-up")
    assert line.startswith("[AttentionStore] session=s-up turn=1 bypass reused=0 prompt=11 ttft_ms=")
    assert metric(proxy, 'attnstore_chat_requests_total{cache="bypass",route="upstream"}') == 1
    assert metric(proxy, 'attnstore_ttft_seconds_count{cache="bypass"}') == 1


class Refusing(LocalBackend):
    """Refuses every local turn as the per-client limit does (429), before any first token."""

    def supports(self, chat):
        return None

    async def handle(self, request, chat, turn):
        raise APIError(429, "Too many concurrent requests from this client.", code="too_many")


@pytest.mark.parametrize("refusal", ["no key", "over the client's limit", "nowhere to serve it"])
def test_a_refused_turn(start_proxy, make_settings, log_lines, refusal):
    # No upstream here: a model that is not local has nowhere to go (OpenAI's 404 model_not_found).
    server = local_proxy_with(start_proxy, make_settings, Refusing(), api_keys=["k"], admin_keys=["admin"])
    auth = {} if refusal == "no key" else {"Authorization": "Bearer k"}
    body = {**LOCAL, "model": "gpt-x"} if refusal == "nowhere to serve it" else LOCAL
    r = http_request("POST", server.url + URL, body, {"X-Session-Id": "s-refused", **auth})
    status, route, cache = {
        "no key": (401, "upstream", "bypass"),
        "over the client's limit": (429, "local", "miss"),
        "nowhere to serve it": (404, "upstream", "bypass"),
    }[refusal]
    assert r.status == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    headers = store_headers_of(r)
    assert headers["x-attentionstore-route"] == route and headers["x-attentionstore-cache"] == cache
    assert headers["x-attentionstore-session"] == "s-refused" and headers["x-attentionstore-replica"] == "r1"
    [line] = log_lines("s-refused")
    assert line.startswith(f"[AttentionStore] session=s-refused turn=0 {cache} reused=0 prompt=0 ttft_ms=")
    assert metric(server, f'attnstore_chat_requests_total{{cache="{cache}",route="{route}"}}', "admin") == 1
    # Refused before a first token: counted, but no TTFT sample.
    assert metric(server, f'attnstore_ttft_seconds_count{{cache="{cache}"}}', "admin") == 0


@pytest.mark.parametrize("where", ["local", "upstream"])
def test_an_error(start_proxy, make_settings, start_app, log_lines, where):
    # The upstream: a port that was just served and is now closed, so nothing answers there.
    dead = start_app(web.Application())
    dead.stop()
    settings = make_settings(
        local_runner={"enabled": True, "models": {"local-model": "/nowhere.gguf"}},
        llm_endpoint={"base_url": dead.url + "/v1"},
    )
    server = start_proxy(settings, local_backend=FakeLocal())
    body = {**LOCAL, "boom": True} if where == "local" else {**LOCAL, "model": "gpt-fake"}
    r = http_request("POST", server.url + URL, body, {"X-Session-Id": "s-err"})
    assert r.status == (500 if where == "local" else 502)
    cache = "miss" if where == "local" else "bypass"
    headers = store_headers_of(r)
    assert headers["x-attentionstore-route"] == where and headers["x-attentionstore-cache"] == cache
    [line] = log_lines("s-err")
    assert line.startswith(f"[AttentionStore] session=s-err turn=0 {cache} reused=0 prompt=0 ttft_ms=")
    assert metric(server, f'attnstore_chat_requests_total{{cache="{cache}",route="{where}"}}') == 1


class Streaming(LocalBackend):
    """Streams one event of an l0 hit, then waits for the client to go away (as a long answer would)."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def supports(self, chat):
        return None

    async def handle(self, request, chat, turn):
        at = turn.received_at + 0.002
        turn.local_first_token(cache="l0", reused=7, prompt=9, tiers={"l0": 7}, position_shift=0, at=at)
        resp = web.StreamResponse(headers=turn.headers())
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return resp


async def test_a_local_turn_whose_client_went_away_logs_its_line_too(start_proxy, make_settings, log_lines):
    backend = Streaming()
    server = local_proxy_with(start_proxy, make_settings, backend)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(server.url + URL, json={**LOCAL, "session_id": "s-gone"})
        assert resp.headers["X-AttentionStore-Cache"] == "l0_hit"
        assert await resp.content.readline() == b"data: one\n"
        resp.close()  # the client goes away mid-answer
    assert await asyncio.to_thread(backend.cancelled.wait, 10)
    [line] = await asyncio.to_thread(log_lines, "s-gone")
    assert line.startswith("[AttentionStore] session=s-gone turn=0 l0_hit reused=7 prompt=9 ttft_ms=2.00")
