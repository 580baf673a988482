"""The vLLM engine's backend without vLLM: the proxy in front of a fake vLLM that speaks /v1/completions
as vLLM does and reports to the real store (its socket, its service) as attnstore's connector does.

What the backend owes every local turn whatever the engine: the X-AttentionStore-* headers from the
store's report, usage.cached_tokens equal to the reused tokens, the log line, the session indexed with
the keys the turn saved; a miss at a full queue upstream (or 503), a hit still local; DELETE forgetting
in the store; the store's stats in /v1/attention_store/stats; vLLM's refusals as the client's 400."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from aiohttp import web

from engine_api.errors import EngineError
from engine_api.prompt import render_prompt
from engine_api.sampling import SamplingParams
from engine_api.tokenizers import ThreadTokenizers
from engine_api.turn import GenerationRequest
from kvtier import KVLayout, KVStore, StoreConfig
from proxy.cluster.session_index import MemorySessionIndex, SessionRecord
from proxy.http.app import build_app
from proxy.serving.service import LocalServing
from proxy.upstream.forward import upstream_fallback
from tests.servers import http_request
from tests.support.threaded_server import free_port
from tests.support.waiting import wait_until
from tests.tiny_model import tiny_tokenizer
from vllm_engine.engine import ServedModel, VllmEngine
from vllm_engine.link.service import StoreService
from vllm_engine.link.wire import AsyncStoreClient, StoreClient, StoreSocketServer

MODEL = "tiny"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
ANSWER = ["Hel", "lo", " there"]
ANSWER_IDS = tiny_tokenizer().encode("".join(ANSWER), add_special_tokens=False)  # what vLLM generated


class FakeVllm:
    """vLLM's completions stream; with a store, the connector's reports and saves around each request."""

    def __init__(self, service: StoreService) -> None:
        self.service = service
        self.bodies: list[dict[str, Any]] = []
        self.hold = threading.Event()  # cleared: answers wait (the test thread sets it again)
        self.hold.set()
        self.refuse: str | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.refuse:
            return web.json_response({"error": {"message": self.refuse}}, status=400)
        params = body["kv_transfer_params"]["attnstore"]
        prompt = body["prompt"]
        stored = self.service.store.lookup(params["tenant"], prompt, count=False).tokens
        self.service.report(
            params["turn"], {"l0": 0, "l1": min(stored, len(prompt) - 1), "l2": 0}, len(prompt)
        )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while not self.hold.is_set():
            await asyncio.sleep(0.01)
        for text in ANSWER:
            await resp.write(
                b"data: " + orjson.dumps({"choices": [{"text": text, "finish_reason": None}]}) + b"\n\n"
            )
        await resp.write(
            b"data: " + orjson.dumps({"choices": [{"text": "", "finish_reason": "length"}]}) + b"\n\n"
        )
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ANSWER)}
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        tokens = [*prompt, *ANSWER_IDS][:-1]  # what the connector saves when the request finishes
        kv = [(torch.randn(2, len(tokens), 4), torch.randn(2, len(tokens), 4)) for _ in range(2)]
        keys = self.service.store.put(params["tenant"], tokens, kv, session=params["session"])
        self.service.saved(params["turn"], keys)
        return resp


class FakeServer:
    """What the backend reads of a running vLLM (server.VllmServer): its URL and its store's socket."""

    def __init__(self, url: str, socket: Path) -> None:
        self.name, self.url, self.store = MODEL, url, StoreClient(socket)

    def stop(self) -> None:
        self.store.close()


@pytest.fixture
def stack(tmp_path: Path, start_app, make_settings, fake_upstream) -> Iterator[Any]:
    store = KVStore(StoreConfig(0, 1 << 20, 1 << 22, tmp_path / "kv", chunk_tokens=8), LAYOUT, "fp")
    service = StoreService(store)
    socket = tmp_path / "store.sock"
    server = StoreSocketServer(socket, service.handlers())
    fake = FakeVllm(service)
    fake_url = start_app(fake.app()).url
    settings = make_settings(
        llm_endpoint={"model": MODEL}, local_runner={"enabled": True, "models": {MODEL: "unused"}}
    )
    index = MemorySessionIndex()

    def backend() -> LocalServing:
        served = ServedModel(
            MODEL,
            FakeServer(fake_url, socket),
            ThreadTokenizers(tiny_tokenizer()),
            512,
            "float32",
            AsyncStoreClient(socket),
        )  # type: ignore[arg-type]
        return LocalServing(
            VllmEngine({MODEL: served}, max_running=1, max_queue=1, timeout_s=600),
            index,
            replica="r1",
            reuse=True,
            default_max_tokens=16,
            truncate_on_overflow=True,
            overflow=upstream_fallback,
            upstream_model=MODEL,
        )

    proxy = start_app(build_app(settings, local=backend, index=index))
    yield proxy.url, fake, index, fake_upstream
    server.close()
    store.close()


def chat(url: str, messages: list[dict[str, str]], *, stream: bool = False, session: str = "s1"):
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return http_request(
        "POST", url + "/v1/chat/completions", body, headers={"X-Session-Id": session}, timeout=60
    )


def usage_of(result) -> dict[str, Any]:
    if result.headers["content-type"].startswith("text/event-stream"):
        events = [
            orjson.loads(line[6:]) for line in result.body.split(b"\n\n") if line.startswith(b"data: {")
        ]
        assert "".join(
            e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]
        ) == "".join(ANSWER)
        return events[-1]["usage"]
    assert result.json()["choices"][0]["message"]["content"] == "".join(ANSWER)
    return result.json()["usage"]


TURN_1 = [{"role": "user", "content": "Hi there, how are you"}]
TURN_2 = [*TURN_1, {"role": "assistant", "content": "".join(ANSWER)}, {"role": "user", "content": "Fine"}]


@pytest.mark.parametrize("stream", [False, True])
def test_headers_usage_and_log_line_come_from_the_stores_report(stack, caplog, stream):
    caplog.set_level(logging.INFO, logger="attnstore")
    url, fake, index, _ = stack
    first = chat(url, TURN_1, stream=stream)
    assert first.status == 200, first.body
    assert (
        first.headers["x-attentionstore-cache"] == "miss"
        and first.headers["x-attentionstore-route"] == "local"
    )
    assert usage_of(first)["prompt_tokens_details"]["cached_tokens"] == 0
    sent = fake.bodies[-1]
    assert sent["kv_transfer_params"]["attnstore"]["tenant"] == "anonymous"
    assert sent["kv_transfer_params"]["attnstore"]["session"] == "s1"
    assert sent["cache_salt"] == "attnstore-anonymous" and sent["stream"] is True
    assert sent["prompt"] == render_prompt(tiny_tokenizer(), TURN_1)
    record = asyncio.run(index.get("anonymous", "s1"))
    assert record is not None and record.replica == "r1" and record.chunk_keys
    second = chat(url, TURN_2, stream=stream)
    reused = int(second.headers["x-attentionstore-reused-tokens"])
    assert second.headers["x-attentionstore-cache"] == "l1_hit"
    assert reused == len(sent["prompt"]) + len(ANSWER_IDS) - 1  # the history: prompt and answer
    assert second.headers["x-attentionstore-tiers"] == f"l0=0,l1={reused},l2=0"
    assert usage_of(second)["prompt_tokens_details"]["cached_tokens"] == reused
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("[AttentionStore] session=s1 ")
    ]
    assert lines[0].startswith("[AttentionStore] session=s1 turn=0 miss reused=0 prompt=")
    assert lines[1].startswith(f"[AttentionStore] session=s1 turn=1 l1_hit reused={reused} prompt=")


def test_a_miss_at_a_full_queue_goes_upstream_and_a_hit_stays(stack):
    url, fake, _, upstream = stack
    assert chat(url, TURN_1, session="warm").status == 200  # stored: TURN_2 is a hit from now on
    fake.hold.clear()
    blocked = [
        threading.Thread(target=chat, args=(url, [{"role": "user", "content": f"busy {i}"}]))
        for i in range(2)
    ]
    for t in blocked:
        t.start()
    wait_until(lambda: len(fake.bodies) >= 3, "two requests holding the queue", timeout=10)
    miss = chat(url, [{"role": "user", "content": "a new conversation"}], session="other")
    assert miss.headers["x-attentionstore-route"] == "upstream" and len(upstream.requests) == 1
    hit_thread = threading.Thread(target=chat, args=(url, TURN_2), kwargs={"session": "warm"})
    hit_thread.start()
    wait_until(lambda: len(fake.bodies) >= 4, "the hit sent to vLLM although the queue is full", timeout=10)
    fake.hold.set()
    for t in [*blocked, hit_thread]:
        t.join(30)
    assert len(upstream.requests) == 1


def test_delete_forgets_the_session_in_the_store(stack):
    url, *_ = stack
    assert chat(url, TURN_1).status == 200
    deleted = http_request("DELETE", url + "/v1/attention_store/sessions/s1").json()
    assert deleted["deleted"] is True and deleted["chunks"] > 0
    assert chat(url, TURN_2).headers["x-attentionstore-cache"] == "miss"


def test_stats_are_the_stores(stack):
    url, *_ = stack
    chat(url, TURN_1)
    stats = http_request("GET", url + "/v1/attention_store/stats").json()
    assert stats["models"][MODEL]["tiers"]["l1"]["entries"] > 0
    assert stats["runner"]["admitted"] == 1


def test_vllms_refusal_is_the_clients_400(stack):
    url, fake, *_ = stack
    fake.refuse = "max_tokens is too large"
    result = chat(url, TURN_1)
    error = result.json()["error"]
    assert result.status == 400 and error["message"] == "vLLM: max_tokens is too large"
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")


def test_an_unreachable_vllm_is_an_engine_error_the_client_gets_as_a_502(tmp_path):
    """The engine raises no proxy error: its EngineError is what the serving layer answers (502)."""
    served = ServedModel(
        MODEL,
        FakeServer(f"http://127.0.0.1:{free_port()}", tmp_path / "none.sock"),
        ThreadTokenizers(tiny_tokenizer()),
        512,
        "float32",
        None,
    )  # type: ignore[arg-type]
    engine = VllmEngine({MODEL: served}, max_running=1, max_queue=1, timeout_s=600)

    async def first() -> None:
        events = engine.run(
            GenerationRequest(MODEL, [1, 2, 3], SamplingParams(max_tokens=4)), may_overflow=False
        )
        try:
            await anext(events)
        finally:
            await events.aclose()
            await engine.aclose()

    with pytest.raises(EngineError) as err:
        asyncio.run(first())
    assert (err.value.status, err.value.type, err.value.code) == (502, "server_error", None)
    assert err.value.message.startswith(f"vLLM for {MODEL} failed: ")


def test_keys_another_replica_stored_for_the_session_go_to_vllm_as_hints(stack):
    url, fake, index, _ = stack
    asyncio.run(index.put("anonymous", "moved", SessionRecord("r2", "l1", ["k1", "k2"], 40)))
    assert chat(url, TURN_1, session="moved").status == 200
    assert fake.bodies[-1]["kv_transfer_params"]["attnstore"]["hints"] == ["k1", "k2"]
    assert chat(url, TURN_1, session="moved").status == 200  # now recorded here: nothing to adopt
    assert fake.bodies[-1]["kv_transfer_params"]["attnstore"]["hints"] == []


def test_completions_and_responses_run_on_the_vllm_engine_through_the_same_serving_layer(stack):
    """Issue 26: the Completions and Responses APIs are written once above the engines; on vLLM a
    completion's ids go as they are, and a Responses follow-up reuses its stored conversation's KV."""
    url, fake, *_ = stack
    prompt = "Hi there, how are you doing today"
    done = http_request("POST", url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3})
    assert done.status == 200 and done.json()["choices"][0]["text"] == "".join(ANSWER)
    assert fake.bodies[-1]["prompt"] == tiny_tokenizer().encode(prompt)
    longer = prompt + "".join(ANSWER) + " and more"
    again = http_request("POST", url + "/v1/completions", {"model": MODEL, "prompt": longer, "max_tokens": 3})
    assert again.headers["x-attentionstore-cache"] == "l1_hit"
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    first = http_request("POST", url + "/v1/responses", {"model": MODEL, "input": "Hi there, how are you"})
    body = first.json()
    assert first.status == 200 and body["object"] == "response" and body["status"] == "incomplete"
    assert body["output"][0]["content"][0]["text"] == "".join(ANSWER)
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}  # the fake's finish: "length"
    follow = {"model": MODEL, "input": "Fine", "previous_response_id": body["id"], "stream": True}
    second = http_request("POST", url + "/v1/responses", follow)
    assert second.headers["x-attentionstore-cache"] == "l1_hit"
    assert fake.bodies[-1]["prompt"] == render_prompt(tiny_tokenizer(), TURN_2)
    events = [orjson.loads(line[6:]) for line in second.body.split(b"\n") if line.startswith(b"data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 0
