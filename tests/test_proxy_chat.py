"""POST /v1/chat/completions through the proxy to a fake upstream, over real loopback HTTP."""

import asyncio
import contextlib
import logging
import threading
import time

import aiohttp
import openai
import orjson
import pytest
import urllib3
from aiohttp import web

from proxy.turns.session import prefix_fingerprint
from tests.servers import http_request
from tests.support.waiting import wait_until

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
STORE_HEADERS = (
    "x-attentionstore-cache",
    "x-attentionstore-route",
    "x-attentionstore-reused-tokens",
    "x-attentionstore-session",
    "x-attentionstore-ttft-ms",
)


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="client-key", max_retries=0, timeout=20, **kw)


def assert_bypass_headers(headers, session=None):
    for name in STORE_HEADERS:
        assert name in headers, name
    assert headers["x-attentionstore-cache"] == "bypass"
    assert headers["x-attentionstore-route"] == "upstream"
    assert headers["x-attentionstore-reused-tokens"] == "0"
    assert float(headers["x-attentionstore-ttft-ms"]) >= 0
    if session is not None:
        assert headers["x-attentionstore-session"] == session


def test_openai_client_non_streamed(proxy, fake_upstream):
    raw = client(proxy).chat.completions.with_raw_response.create(model="gpt-fake", messages=MSGS)
    completion = raw.parse()
    assert completion.choices[0].message.content == "Hello from the fake upstream."
    assert completion.usage.prompt_tokens == fake_upstream.prompt_tokens
    assert_bypass_headers(raw.headers, session=prefix_fingerprint("gpt-fake", MSGS))
    sent = fake_upstream.requests[-1]
    assert sent.path == "/v1/chat/completions"
    assert sent.json == {"model": "gpt-fake", "messages": MSGS}


@pytest.mark.parametrize("include_usage", [True, False])
def test_openai_client_streamed(proxy, fake_upstream, include_usage):
    kwargs = {"stream_options": {"include_usage": True}} if include_usage else {}
    raw = client(proxy).chat.completions.with_raw_response.create(
        model="gpt-fake", messages=MSGS, stream=True, extra_body={"session_id": "conv-1"}, **kwargs
    )
    assert_bypass_headers(raw.headers, session="conv-1")
    assert raw.headers["content-type"].startswith("text/event-stream")
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from the fake upstream."
    usage = [c.usage for c in chunks if c.usage]
    assert [u.prompt_tokens for u in usage] == ([fake_upstream.prompt_tokens] if include_usage else [])
    assert "session_id" not in fake_upstream.requests[-1].json


def _sse(content: str) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "gpt-fake"}
    chunk["choices"] = [{"index": 0, "delta": {"content": content}}]
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def test_stream_is_passed_through_as_it_arrives(start_app, start_proxy, make_settings):
    """The first chunk reaches the client while the upstream still holds back the rest of its answer."""
    rest = threading.Event()

    async def held_back(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse("first"))
        await asyncio.to_thread(rest.wait, 30)  # a proxy that buffers never shows the client "first"
        await resp.write(_sse(" second") + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    upstream = web.Application()
    upstream.router.add_post("/v1/chat/completions", held_back)
    url = start_app(upstream).url
    server = start_proxy(make_settings(llm_endpoint={"base_url": url + "/v1"}))
    chunks = iter(client(server).chat.completions.create(model="gpt-fake", messages=MSGS, stream=True))
    assert next(chunks).choices[0].delta.content == "first"
    rest.set()
    assert [c.choices[0].delta.content for c in chunks] == [" second"]


def test_session_field_stripped_and_header_session(proxy, fake_upstream):
    body = {"model": "gpt-fake", "messages": MSGS, "session_id": "abc", "temperature": 0}
    r = http_request("POST", proxy.url + "/v1/chat/completions", body)
    assert r.status == 200 and r.headers["x-attentionstore-session"] == "abc"
    assert fake_upstream.requests[-1].json == {"model": "gpt-fake", "messages": MSGS, "temperature": 0}
    # Header form: the body goes upstream byte for byte, the header does not go at all.
    raw = b'{"model": "gpt-fake",   "messages": [{"role":"user","content":"x"}]}'
    r = http_request(
        "POST",
        proxy.url + "/v1/chat/completions",
        raw,
        headers={"X-Session-Id": "hdr-1", "Content-Type": "application/json"},
    )
    assert r.status == 200 and r.headers["x-attentionstore-session"] == "hdr-1"
    assert fake_upstream.requests[-1].body == raw
    assert "x-session-id" not in {k.lower() for k in fake_upstream.requests[-1].headers}


def test_custom_session_key(fake_upstream, start_proxy, make_settings):
    server = start_proxy(make_settings(attention_store={"session_key": "conversation"}))
    raw = client(server).chat.completions.with_raw_response.create(
        model="gpt-fake", messages=MSGS, extra_body={"conversation": "c-9", "session_id": "kept"}
    )
    assert raw.headers["x-attentionstore-session"] == "c-9"
    assert fake_upstream.requests[-1].json["session_id"] == "kept"
    assert "conversation" not in fake_upstream.requests[-1].json


def test_derived_session_stable_across_turns(proxy):
    c = client(proxy)
    history = list(MSGS)
    sessions = []
    for turn in range(3):
        raw = c.chat.completions.with_raw_response.create(model="gpt-fake", messages=history)
        sessions.append(raw.headers["x-attentionstore-session"])
        history += [{"role": "assistant", "content": raw.parse().choices[0].message.content}]
        history += [{"role": "user", "content": f"turn {turn + 1}"}]
    assert len(set(sessions)) == 1 and sessions[0].startswith("fp-")
    other = c.chat.completions.with_raw_response.create(
        model="gpt-fake", messages=[{"role": "user", "content": "another conversation"}]
    )
    assert other.headers["x-attentionstore-session"] != sessions[0]


def test_upstream_key_replaces_client_key(proxy, fake_upstream, monkeypatch):
    client(proxy).chat.completions.create(model="gpt-fake", messages=MSGS)
    assert fake_upstream.requests[-1].headers["Authorization"] == "Bearer client-key"
    monkeypatch.setenv("ATTNSTORE_TEST_UPSTREAM_KEY", "sk-upstream")
    client(proxy).chat.completions.create(model="gpt-fake", messages=MSGS)
    assert fake_upstream.requests[-1].headers["Authorization"] == "Bearer sk-upstream"


def test_client_headers_passed_through(proxy, fake_upstream):
    c = client(proxy, default_headers={"OpenAI-Organization": "org-1", "X-Custom": "yes"})
    c.chat.completions.create(model="gpt-fake", messages=MSGS)
    got = fake_upstream.requests[-1].headers
    assert got["OpenAI-Organization"] == "org-1" and got["X-Custom"] == "yes"
    assert got["Host"] != proxy.url.removeprefix("http://")


def test_upstream_error_passed_through(proxy, fake_upstream):
    fake_upstream.mode = "error"
    with pytest.raises(openai.RateLimitError) as err:
        client(proxy).chat.completions.create(model="gpt-fake", messages=MSGS)
    assert err.value.status_code == 429
    assert err.value.response.content == fake_upstream.error_body
    assert_bypass_headers(err.value.response.headers)


def test_upstream_error_on_stream_passed_through(proxy, fake_upstream):
    fake_upstream.mode = "error"
    fake_upstream.error_status = 400
    with pytest.raises(openai.BadRequestError) as err:
        client(proxy).chat.completions.create(model="gpt-fake", messages=MSGS, stream=True)
    assert err.value.response.content == fake_upstream.error_body
    assert_bypass_headers(err.value.response.headers)


def test_upstream_down_is_502(start_proxy, make_settings, start_app):
    from aiohttp import web

    from tests.servers import AppServer

    # A port that was just served and is now closed: nothing listens there.
    dead = AppServer(web.Application()).start()
    dead.stop()
    server = start_proxy(make_settings(llm_endpoint={"base_url": dead.url + "/v1"}))
    with pytest.raises(openai.APIStatusError) as err:
        client(server).chat.completions.create(model="gpt-fake", messages=MSGS)
    assert err.value.status_code == 502
    body = err.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert_bypass_headers(err.value.response.headers)


def test_upstream_slow_is_504(fake_upstream, start_proxy, make_settings):
    fake_upstream.mode = "hang"
    server = start_proxy(make_settings(proxy={"upstream_timeout_s": 0.5}))
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client(server).chat.completions.create(model="gpt-fake", messages=MSGS)
    assert err.value.status_code == 504
    assert time.monotonic() - start < 5
    assert err.value.response.json()["error"]["type"] == "upstream_timeout"
    # The proxy is still healthy afterwards.
    fake_upstream.mode = "ok"
    assert client(server).chat.completions.create(model="gpt-fake", messages=MSGS).choices


async def test_upstream_silent_mid_stream_ends_the_stream_with_an_error_event_unfinished(
    fake_upstream, start_proxy, make_settings
):
    fake_upstream.stall_after = 2
    server = start_proxy(make_settings(proxy={"upstream_timeout_s": 0.5}))
    body = {"model": "gpt-fake", "messages": MSGS, "stream": True}
    received = b""
    start = time.monotonic()
    async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        try:
            async for chunk in resp.content.iter_any():
                received += chunk
        except aiohttp.ClientPayloadError:
            pass  # the unfinished chunked body is the signal
    assert time.monotonic() - start < 10
    # Two events, then one error event saying why (issue 13), and no [DONE].
    assert received.count(b"data: ") == 3 and b"[DONE]" not in received
    assert b'"type":"upstream_timeout"' in received.split(b"data: ")[-1]
    fake_upstream.stall_after = -1
    assert client(server).chat.completions.create(model="gpt-fake", messages=MSGS).choices


async def test_client_disconnect_closes_upstream(proxy, fake_upstream, caplog):
    """A client gone mid-stream: the upstream request is closed, and the proxy says so quietly (no
    error with a traceback in its log: nothing failed)."""
    caplog.set_level(logging.DEBUG)
    fake_upstream.chunk_delay_s = 0.1
    fake_upstream.n_chunks = 100  # ~10 s if nobody stops it
    body = {"model": "gpt-fake", "messages": MSGS, "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(proxy.url + "/v1/chat/completions", json=body)
        assert resp.status == 200
        first = await resp.content.readany()
        assert first.startswith(b"data: ")
        resp.close()  # drop the connection mid-stream
    closed = await asyncio.to_thread(fake_upstream.disconnected.wait, 5)
    assert closed, "the upstream request was not closed"
    await asyncio.sleep(0.5)  # the proxy's last write to the gone client, and whatever it logs
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


def test_no_upstream_and_not_local_is_openais_404(start_proxy, make_settings):
    server = start_proxy(make_settings())  # no fake_upstream fixture: base_url is ""
    with pytest.raises(openai.NotFoundError) as err:
        client(server).chat.completions.create(model="gpt-x", messages=MSGS)
    msg = err.value.response.json()["error"]["message"]
    assert "no upstream" in msg and "gpt-x" in msg


def wait_for_log(caplog, needle):
    """The proxy logs from its own thread, possibly just after the client saw the end of the answer."""

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "attnstore" and needle in r.getMessage()]

    wait_until(lines, f"a log line with {needle!r}", timeout=5)
    return lines()[0]


def test_log_line(proxy, fake_upstream, caplog):
    caplog.set_level(logging.INFO, logger="attnstore")
    msgs = MSGS + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    client(proxy).chat.completions.create(model="gpt-fake", messages=msgs, extra_body={"session_id": "log-s"})
    line = wait_for_log(caplog, "session=log-s ")
    assert line.startswith("[AttentionStore] session=log-s turn=1 bypass reused=0 prompt=11 ttft_ms=")
    assert float(line.rsplit("=", 1)[1]) > 0
    assert not any("client-key" in r.getMessage() for r in caplog.records)


def test_streamed_log_line_has_usage(proxy, caplog):
    caplog.set_level(logging.INFO, logger="attnstore")
    stream = client(proxy).chat.completions.create(
        model="gpt-fake", messages=MSGS, stream=True, stream_options={"include_usage": True}
    )
    assert len(list(stream)) == 9
    line = wait_for_log(caplog, f"session={prefix_fingerprint('gpt-fake', MSGS)} ")
    assert " turn=0 bypass reused=0 prompt=11 ttft_ms=" in line


def test_log_line_when_client_leaves_mid_stream(proxy, fake_upstream, caplog):
    caplog.set_level(logging.INFO, logger="attnstore")
    fake_upstream.chunk_delay_s = 0.05
    fake_upstream.n_chunks = 100
    stream = client(proxy).chat.completions.create(
        model="gpt-fake", messages=MSGS, stream=True, extra_body={"session_id": "gone"}
    )
    next(iter(stream))
    stream.close()
    assert " bypass reused=0 prompt=0 " in wait_for_log(caplog, "session=gone ")


def test_a_client_gone_while_its_answer_is_written_is_no_error(start_app, make_settings, caplog):
    """A handler whose write finds the client gone (ConnectionResetError: the window between a
    stream's last event and its end, where the openai client hangs up) ends quietly: no error and no
    traceback in the log, and the server goes on serving."""
    from proxy.http.middleware import error_middleware
    from proxy.settings import SETTINGS

    async def gone(request: web.Request) -> web.StreamResponse:
        stream = web.StreamResponse()
        await stream.prepare(request)
        await stream.write(b"data: [DONE]\n\n")
        raise ConnectionResetError("Cannot write to closing transport")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[error_middleware])
    app[SETTINGS] = make_settings()
    app.router.add_get("/gone", gone)
    app.router.add_get("/ok", ok)
    server = start_app(app)
    caplog.set_level(logging.DEBUG)
    with contextlib.suppress(urllib3.exceptions.HTTPError):  # the connection closed under the answer
        urllib3.request("GET", server.url + "/gone", timeout=5, retries=False)
    assert urllib3.request("GET", server.url + "/ok", timeout=5, retries=False).data == b"ok"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
