"""Every path of the API that attnstore does not serve for a local model goes to the upstream as it came
(the project's contract and docs/api.md, "Pass-through"): the official openai client against the fake
upstream over real loopback HTTP, answers byte for byte, uploads and answers streamed, the one header
filter, the same errors as chat, and the proxy's own paths never forwarded."""

from __future__ import annotations

import asyncio
import io
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from proxy.metrics import passthrough_path_label
from tests.servers import AppServer, http_request
from tests.support.fake_upstream import ANSWERS, SPEECH_CHUNK, TEXT

KEY = "proxy-client-key"


def client(server: AppServer, key: str = "client-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=20)


def assert_passed_through(headers: Any) -> None:
    assert headers["x-attentionstore-route"] == "upstream"
    assert headers["x-attentionstore-replica"]


def assert_openai_error(body: Any, type_: str) -> dict[str, Any]:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == type_
    return err


class GatedUpload(io.BytesIO):
    """A file whose bytes past its first read are held back until `gate` is set (by the fake upstream,
    when the first bytes of the upload reach it), for `timeout_s` at most: a proxy that buffers the
    upload before forwarding it cannot open the gate, and `opened` stays False."""

    def __init__(self, data: bytes, gate: threading.Event, timeout_s: float = 10) -> None:
        super().__init__(data)
        self.gate, self.timeout_s = gate, timeout_s
        self.opened: bool | None = None

    def read(self, size: int | None = -1) -> bytes:
        if self.tell() > 0 and self.opened is None:
            self.opened = self.gate.wait(self.timeout_s)
        return super().read(size)


def audio(size: int) -> bytes:
    return random.Random(size).randbytes(size)


# Each call of the openai client that the proxy passes through as it came, with the (method, path) of
# the fake upstream's answer.
CALLS: dict[str, tuple[tuple[str, str], Callable[[openai.OpenAI], Any]]] = {
    "embeddings": (
        ("POST", "/v1/embeddings"),
        lambda c: c.embeddings.with_raw_response.create(model="text-embedding-fake", input="hi"),
    ),
    "files.list": (("GET", "/v1/files"), lambda c: c.files.with_raw_response.list(purpose="batch")),
    "moderations": (
        ("POST", "/v1/moderations"),
        lambda c: c.moderations.with_raw_response.create(model="omni-moderation-fake", input="hi"),
    ),
    "responses": (
        ("POST", "/v1/responses"),
        lambda c: c.responses.with_raw_response.create(model="gpt-fake", input="hi"),
    ),
    "completions": (
        ("POST", "/v1/completions"),
        lambda c: c.completions.with_raw_response.create(model="gpt-fake", prompt="hi"),
    ),
    "transcriptions": (
        ("POST", "/v1/audio/transcriptions"),
        lambda c: c.audio.transcriptions.with_raw_response.create(
            model="whisper-fake", file=("a.wav", audio(1000), "audio/wav")
        ),
    ),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_the_upstreams_answer_comes_back_unchanged(proxy, fake_upstream, name):
    (method, path), call = CALLS[name]
    raw = call(client(proxy))
    assert raw.status_code == 200
    assert raw.content == orjson.dumps(ANSWERS[(method, path)])
    assert_passed_through(raw.headers)
    raw.parse()  # the client's own types take it
    sent = fake_upstream.requests[-1]
    assert (sent.method, sent.path.split("?")[0]) == (method, path)
    assert sent.headers["Authorization"] == "Bearer client-key"  # no proxy keys: the client's own


def test_the_answers_say_what_the_upstream_said(proxy, fake_upstream):
    c = client(proxy)
    assert c.embeddings.create(model="text-embedding-fake", input="hi").data[0].embedding == [0.25, -0.5, 1.0]
    assert [f.id for f in c.files.list()] == ["file-abc123"]
    assert c.responses.create(model="gpt-fake", input="hi").output_text == TEXT
    assert c.completions.create(model="gpt-fake", prompt="hi").choices[0].text == TEXT
    assert fake_upstream.requests[-1].json == {"model": "gpt-fake", "prompt": "hi"}
    assert fake_upstream.requests[1].path == "/v1/files"


def test_a_multi_megabyte_upload_reaches_the_upstream_while_the_client_still_sends_it(proxy, fake_upstream):
    data = audio(6 * 1024 * 1024)
    upload = GatedUpload(data, fake_upstream.upload_started)
    raw = client(proxy).audio.transcriptions.with_raw_response.create(
        model="whisper-fake", file=("speech.wav", upload, "audio/wav")
    )
    assert upload.opened is True, "the upstream saw no byte before the client had sent the whole upload"
    assert raw.status_code == 200 and raw.parse().text == TEXT
    assert_passed_through(raw.headers)
    sent = fake_upstream.requests[-1]
    assert data in sent.body and sent.headers["Content-Type"].startswith("multipart/form-data; boundary=")
    # Sent with the client's Content-Length, not re-chunked.
    assert int(sent.headers["Content-Length"]) == len(sent.body) and "Transfer-Encoding" not in sent.headers


async def test_a_chunked_upload_is_streamed_up_and_bounded_by_max_body_mb(
    fake_upstream, start_proxy, make_settings
):
    server = start_proxy(make_settings(proxy={"max_body_mb": 1}))
    url = server.url + "/v1/audio/transcriptions"
    headers = {"Content-Type": "multipart/form-data; boundary=b"}

    async def body(n: int):  # no Content-Length: chunked, counted by the proxy as it arrives
        for _ in range(n):
            yield b"x" * 65536

    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=body(8), headers=headers) as resp:  # 512 KiB: within the limit
            assert resp.status == 200 and await resp.json() == {"text": TEXT}
        assert fake_upstream.requests[-1].body == b"x" * 65536 * 8
        async with s.post(url, data=body(24), headers=headers) as resp:  # 1.5 MiB
            assert resp.status == 413
            assert (
                assert_openai_error(await resp.json(), "invalid_request_error")["code"] == "request_too_large"
            )
            assert resp.headers["x-attentionstore-route"] == "upstream"
    assert len(fake_upstream.requests) == 1  # the oversized one never completed upstream


def test_an_upload_declared_larger_than_max_body_mb_is_refused_before_the_upstream_sees_it(
    fake_upstream, start_proxy, make_settings
):
    server = start_proxy(make_settings(proxy={"max_body_mb": 1}))
    with pytest.raises(openai.APIStatusError) as err:
        client(server).audio.transcriptions.create(model="whisper-fake", file=("a.wav", audio(2 << 20)))
    assert err.value.status_code == 413
    assert_openai_error(err.value.response.json(), "invalid_request_error")
    assert not fake_upstream.upload_started.is_set() and fake_upstream.requests == []


def test_a_client_gone_mid_upload_closes_the_upstream_connection(proxy, fake_upstream):
    head = (
        "POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 8000000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(head.encode() + b"x" * 256 * 1024)
        assert fake_upstream.upload_started.wait(5), "the upload never reached the upstream"
    assert fake_upstream.upload_cut.wait(5), "the upstream's connection stayed open"
    assert http_request("GET", proxy.url + "/v1/files").status == 200  # and the proxy goes on


def test_binary_audio_comes_back_chunk_for_chunk(proxy, fake_upstream):
    raw = client(proxy).audio.speech.with_raw_response.create(model="tts-fake", voice="alloy", input="hi")
    assert raw.status_code == 200 and raw.headers["content-type"] == "audio/mpeg"
    assert raw.content == SPEECH_CHUNK * fake_upstream.speech_chunks
    assert_passed_through(raw.headers)


async def test_a_client_gone_mid_answer_closes_the_upstream_connection(proxy, fake_upstream):
    fake_upstream.chunk_delay_s, fake_upstream.speech_chunks = 0.1, 100  # ~10 s if nobody stops it
    body = {"model": "tts-fake", "voice": "alloy", "input": "hi"}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(proxy.url + "/v1/audio/speech", json=body)
        assert resp.status == 200
        assert await resp.content.readany()
        resp.close()
    assert await asyncio.to_thread(fake_upstream.disconnected.wait, 5), "the upstream's answer went on"


def test_a_streamed_response_passes_through_as_it_arrives(proxy, fake_upstream):
    fake_upstream.hold_stream = threading.Event()
    events = iter(client(proxy).responses.create(model="gpt-fake", input="hi", stream=True))
    assert next(events).type == "response.created"  # while the upstream holds back the rest
    fake_upstream.hold_stream.set()
    rest = list(events)
    assert "".join(e.delta for e in rest if e.type == "response.output_text.delta") == TEXT
    assert rest[-1].type == "response.completed" and rest[-1].response.output_text == TEXT


@pytest.mark.parametrize("upstream_key", [None, "sk-upstream"], ids=["no-upstream-key", "upstream-key"])
def test_with_proxy_keys_no_client_key_reaches_the_upstream(
    fake_upstream, start_proxy, make_settings, monkeypatch, upstream_key
):
    if upstream_key:
        monkeypatch.setenv("ATTNSTORE_TEST_UPSTREAM_KEY", upstream_key)
    server = start_proxy(make_settings(proxy={"api_keys": [KEY]}))
    c = client(server, key=KEY)
    for _, call in CALLS.values():
        assert call(c).status_code == 200
    c.audio.speech.create(model="tts-fake", voice="alloy", input="hi").read()
    c.audio.transcriptions.create(model="whisper-fake", file=("a.wav", audio(3 << 20)))  # streamed up
    with pytest.raises(openai.AuthenticationError):
        client(server).embeddings.create(model="text-embedding-fake", input="hi")  # not a key of ours
    assert len(fake_upstream.requests) == len(CALLS) + 2
    for sent in fake_upstream.requests:
        assert sent.headers.get("Authorization") == (f"Bearer {upstream_key}" if upstream_key else None)
        assert not any(KEY in value for value in sent.headers.values()), sent.path


def dead_upstream_url() -> str:
    dead = AppServer(web.Application()).start()  # a port that was just served and is now closed
    dead.stop()
    return dead.url


def test_an_upstream_that_is_down_is_a_502(start_proxy, make_settings):
    server = start_proxy(make_settings(llm_endpoint={"base_url": dead_upstream_url() + "/v1"}))
    for call in (
        lambda c: c.embeddings.create(model="text-embedding-fake", input="hi"),
        lambda c: c.files.list(),
        lambda c: c.audio.transcriptions.create(model="whisper-fake", file=("a.wav", audio(1 << 20))),
    ):
        with pytest.raises(openai.APIStatusError) as err:
            call(client(server))
        assert err.value.status_code == 502
        assert_openai_error(err.value.response.json(), "upstream_error")
        assert_passed_through(err.value.response.headers)


def test_an_upstream_that_hangs_is_a_504(fake_upstream, start_proxy, make_settings):
    fake_upstream.mode = "hang"
    server = start_proxy(make_settings(proxy={"upstream_first_byte_timeout_s": 0.5}))
    for call in (
        lambda c: c.embeddings.create(model="text-embedding-fake", input="hi"),
        lambda c: c.files.list(),
        # The clock starts once the upload is through: a slow upload is not the upstream's silence.
        lambda c: c.audio.transcriptions.create(model="whisper-fake", file=("a.wav", audio(4 << 20))),
    ):
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            call(client(server))
        assert err.value.status_code == 504 and time.monotonic() - start < 5
        assert_openai_error(err.value.response.json(), "upstream_timeout")
        assert_passed_through(err.value.response.headers)
    assert fake_upstream.upload_started.is_set()  # the upload got through before the wait began


def test_the_responses_side_endpoints_of_upstream_models_go_upstream(proxy, fake_upstream):
    """input_tokens for a model not served here, input_items of a response not stored here: the
    upstream's to answer (the fake knows neither path: its 404 comes back as it said it)."""
    body = orjson.dumps({"model": "gpt-fake", "input": "hi", "session_id": "s"})
    r = http_request(
        "POST", proxy.url + "/v1/responses/input_tokens", body, {"Content-Type": "application/json"}
    )
    assert r.status == 404 and "Invalid URL" in r.json()["error"]["message"]
    sent = fake_upstream.requests[-1]
    assert (sent.method, sent.path, sent.json) == (
        "POST",
        "/v1/responses/input_tokens",
        {"model": "gpt-fake", "input": "hi"},  # the proxy's session field removed
    )
    r = http_request("GET", proxy.url + "/v1/responses/resp_up/input_items?limit=5")
    assert r.status == 404
    assert (fake_upstream.requests[-1].method, fake_upstream.requests[-1].path) == (
        "GET",
        "/v1/responses/resp_up/input_items?limit=5",
    )


def test_an_upstream_error_is_passed_through_as_it_came(proxy, fake_upstream):
    fake_upstream.mode, fake_upstream.error_status = "error", 429
    with pytest.raises(openai.RateLimitError) as err:
        client(proxy).embeddings.create(model="text-embedding-fake", input="hi")
    assert err.value.response.content == fake_upstream.error_body
    assert_passed_through(err.value.response.headers)


def test_an_unknown_path_is_the_upstreams_to_answer(proxy, fake_upstream):
    r = http_request("DELETE", proxy.url + "/v1/vector_stores/vs_1?x=1", headers={"X-Session-Id": "s"})
    assert r.status == 404 and r.json()["error"]["message"] == "Invalid URL (DELETE /v1/vector_stores/vs_1)"
    sent = fake_upstream.requests[-1]
    assert (sent.method, sent.path) == ("DELETE", "/v1/vector_stores/vs_1?x=1")
    assert "X-Session-Id" not in sent.headers  # the proxy's own header, through the one filter


def test_the_proxys_own_paths_are_never_forwarded(proxy, fake_upstream):
    r = http_request("GET", proxy.url + "/v1/chat/completions")
    assert r.status == 405 and r.headers["allow"] == "POST"
    assert_openai_error(r.json(), "invalid_request_error")
    r = http_request("POST", proxy.url + "/v1/attention_store/stats", b"{}")
    assert r.status == 405 and set(r.headers["allow"].split(",")) == {"GET", "HEAD"}
    for method, path in [
        ("GET", "/v1/attention_store/nope"),
        ("POST", "/v1/attention_store"),
        ("GET", "/nope"),
    ]:
        r = http_request(method, proxy.url + path)
        assert r.status == 404, path
        assert_openai_error(r.json(), "invalid_request_error")
    assert fake_upstream.requests == []


def test_without_an_upstream_the_error_names_the_setting(start_proxy, make_settings):
    server = start_proxy(make_settings())  # no fake_upstream: llm_endpoint.base_url is ""
    for call, path in [
        (lambda c: c.embeddings.create(model="text-embedding-fake", input="hi"), "/v1/embeddings"),
        (
            lambda c: c.audio.transcriptions.create(model="w", file=("a.wav", b"RIFF")),
            "/v1/audio/transcriptions",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            call(client(server))
        error = assert_openai_error(err.value.response.json(), "invalid_request_error")
        assert error["code"] == "upstream_not_configured"
        assert "llm_endpoint.base_url" in error["message"] and path in error["message"]
        assert err.value.response.headers["X-AttentionStore-Route"] == "upstream"  # errors included
        assert err.value.response.headers["X-AttentionStore-Replica"]


def test_a_turn_for_a_model_served_nowhere_is_openais_404_model_not_found(start_proxy, make_settings):
    """Chat, completions and responses for a model neither local nor upstream (no upstream configured):
    404 model_not_found, as OpenAI answers an unknown model (the SDK's NotFoundError), naming the
    setting that is missing."""
    c = client(start_proxy(make_settings()))
    for call in [
        lambda: c.chat.completions.create(model="gpt-nowhere", messages=[{"role": "user", "content": "hi"}]),
        lambda: c.completions.create(model="gpt-nowhere", prompt="hi"),
        lambda: c.responses.create(model="gpt-nowhere", input="hi"),
    ]:
        with pytest.raises(openai.NotFoundError) as err:
            call()
        error = assert_openai_error(err.value.response.json(), "invalid_request_error")
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert "gpt-nowhere" in error["message"] and "llm_endpoint.base_url" in error["message"]


def test_a_local_model_without_a_local_implementation_is_a_400(fake_upstream, start_proxy, make_settings):
    local = {"enabled": True, "models": {"local-a": "/x.gguf"}}
    server = start_proxy(make_settings(local_runner=local))
    with pytest.raises(openai.BadRequestError) as err:
        client(server).embeddings.create(model="local-a", input="hi")
    error = assert_openai_error(err.value.response.json(), "invalid_request_error")
    assert (
        error["param"] == "model" and "local-a" in error["message"] and "/v1/embeddings" in error["message"]
    )
    assert fake_upstream.requests == []
    # The upstream's own model, even when also local, and any other model go upstream.
    same = start_proxy(make_settings(local_runner=local, llm_endpoint={"model": "local-a"}))
    assert client(same).embeddings.create(model="local-a", input="hi").data
    assert client(server).embeddings.create(model="text-embedding-fake", input="hi").data
    assert len(fake_upstream.requests) == 2


def test_metrics_count_pass_throughs_by_path_without_ids(proxy, fake_upstream):
    c = client(proxy)
    for _ in range(2):
        c.embeddings.create(model="text-embedding-fake", input="hi")
    c.audio.speech.create(model="tts-fake", voice="alloy", input="hi").read()
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve("file-xyz987")
    http_request("GET", proxy.url + "/v1/whatever-123/abc")
    text = http_request("GET", proxy.url + "/metrics").body.decode()
    samples = dict(re.findall(r"^attnstore_passthrough_requests_total\{(.*)\} (\S+)$", text, re.MULTILINE))
    assert samples == {
        'path="/v1/embeddings",status="2xx"': "2.0",
        'path="/v1/audio/speech",status="2xx"': "1.0",
        'path="/v1/files",status="4xx"': "1.0",
        'path="/v1/other",status="4xx"': "1.0",
    }
    assert "file-xyz987" not in text and "whatever-123" not in text


@pytest.mark.parametrize(
    ("path", "label"),
    [
        ("/v1/embeddings", "/v1/embeddings"),
        ("/v1/audio/transcriptions", "/v1/audio/transcriptions"),
        ("/v1/audio/anything-else", "/v1/audio"),
        ("/v1/files/file-abc/content", "/v1/files"),
        ("/v1/fine_tuning/jobs/ftjob-1/cancel", "/v1/fine_tuning/jobs"),
        ("/v1/batches/batch_1", "/v1/batches"),
        ("/v1/", "/v1/other"),
        ("/v1/f00", "/v1/other"),
    ],
)
def test_the_path_label_stays_small(path, label):
    assert passthrough_path_label(path) == label
