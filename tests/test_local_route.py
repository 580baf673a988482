"""Local serving through the proxy: OpenAI's wire format, routing of unsupported options, queue, disconnects."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest
import urllib3

from tests.model_fixture import MODEL
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.model

HELLO = [{"role": "user", "content": "Say hello."}]
# A streamed turn long enough to hold the only running slot until its client goes away.
LONG_STREAM = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Count to five hundred."}],
    "max_tokens": 400,
    "temperature": 0,
    "stream": True,
}


def post(server, body: dict) -> urllib3.BaseHTTPResponse:
    return urllib3.request(
        "POST",
        server.url + "/v1/chat/completions",
        body=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
        timeout=120,
    )


def test_non_streamed_response_is_openais_format(local_proxy):
    server = local_proxy()
    resp = post(server, {"model": MODEL, "messages": HELLO, "max_tokens": 5, "temperature": 0})
    assert resp.status == 200
    body = orjson.loads(resp.data)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["system_fingerprint"].startswith("fp_")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] <= 5 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert resp.headers["X-AttentionStore-Route"] == "local"


def test_streamed_chunks_share_id_and_end_with_usage_then_done(local_proxy):
    server = local_proxy()
    resp = post(
        server,
        {
            "model": MODEL,
            "messages": HELLO,
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = [line[6:] for line in resp.data.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_openai_client_stop_and_max_completion_tokens(local_proxy):
    server = local_proxy()
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    full = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colors."}],
        temperature=0,
        max_completion_tokens=20,
    )
    text = full.choices[0].message.content
    assert "\n" in text
    cut = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colors."}],
        temperature=0,
        max_completion_tokens=20,
        stop=["\n"],
    )
    assert cut.choices[0].message.content == text[: text.index("\n")]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 17},  # more answers than one local turn serves (n <= 16 is served locally)
        # SmolLM2's own chat template renders no tools: they go where they can be served.
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
    ],
)
def test_unsupported_options_go_upstream(local_proxy, fake_upstream, extra):
    server = local_proxy()
    resp = post(server, {"model": MODEL, "messages": HELLO, **extra})
    assert resp.status == 200
    assert resp.headers["X-AttentionStore-Route"] == "upstream"
    assert resp.headers["X-AttentionStore-Cache"] == "bypass"
    assert resp.headers["X-AttentionStore-Replica"]
    assert "X-AttentionStore-Tiers" not in resp.headers  # local turns only
    assert len(fake_upstream.requests) == 1


def test_unsupported_options_without_upstream_get_a_clear_400(local_proxy):
    server = local_proxy()
    resp = post(server, {"model": MODEL, "messages": HELLO, "n": 17})
    assert resp.status == 400
    error = orjson.loads(resp.data)["error"]
    assert "n > 16" in error["message"] and "no upstream" in error["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"temperature": 5}, "temperature"), ({"max_tokens": 0}, "max_tokens"), ({"stop": 3}, "stop")],
)
def test_bad_sampling_values_are_400(local_proxy, extra, param):
    resp = post(local_proxy(), {"model": MODEL, "messages": HELLO, **extra})
    assert resp.status == 400 and orjson.loads(resp.data)["error"]["param"] == param


def test_models_lists_the_local_model(local_proxy):
    data = orjson.loads(urllib3.request("GET", local_proxy().url + "/v1/models").data)["data"]
    assert MODEL in [m["id"] for m in data]


async def runner_is(http: aiohttp.ClientSession, url: str, **want: int) -> bool:
    async with http.get(url + "/v1/attention_store/stats") as resp:
        runner = (await resp.json())["runner"]
    return all(runner[k] == v for k, v in want.items())


async def test_queue_full_is_503_and_disconnect_cancels(local_proxy):
    server = local_proxy(local_runner={"max_queue": 1, "max_running": 1})
    long = LONG_STREAM
    async with aiohttp.ClientSession() as http:
        url = server.url + "/v1/chat/completions"
        running = await http.post(url, json=long)  # streaming: its headers arrive with the first token
        waiting = asyncio.ensure_future(http.post(url, json={**long, "max_tokens": 2, "stream": False}))
        # The second request waits in the queue (the first holds the only running slot): the queue is full.
        await async_wait_until(lambda: runner_is(http, server.url, queued=1), "the second request queued", 30)
        refused = await http.post(url, json={**long, "max_tokens": 2, "stream": False})
        assert refused.status == 503
        assert (await refused.json())["error"]["code"] == "queue_full"
        running.close()  # the client goes away mid-stream: its job must stop and free the worker
        finished = await waiting
        assert finished.status == 200
        # The worker settles its counts just after the last job's answer went out.
        await async_wait_until(
            lambda: runner_is(http, server.url, queued=0, running=0, cancelled=1), "the runner idle", 10
        )


def test_a_prompt_longer_than_the_context_is_a_400_naming_it(local_proxy):
    resp = post(local_proxy(), {"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]})
    assert resp.status == 400
    error = orjson.loads(resp.data)["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    # An error answer carries the X-AttentionStore-* headers too: a local turn that reused nothing.
    assert (
        resp.headers["X-AttentionStore-Route"] == "local" and resp.headers["X-AttentionStore-Cache"] == "miss"
    )
    assert resp.headers["X-AttentionStore-Reused-Tokens"] == "0" and resp.headers["X-AttentionStore-Session"]


def test_healthz_names_each_local_models_device_dtype_and_batching(local_proxy):
    server = local_proxy(local_runner={"max_batch_tokens": 64, "max_running_kv_mb": 64})

    def model_health() -> dict:
        return orjson.loads(urllib3.request("GET", server.url + "/healthz").data)["local"][MODEL]

    wait_until(lambda: model_health()["warm_up"] != "pending", "the warm-up")  # before any request
    model = model_health()
    assert model.pop("warm_up").startswith("done in "), model
    dense = model.pop("dense")  # the machine decides: oneDNN packs float32 weights where it can
    assert dense.startswith(("oneDNN packed (", "plain: ")), dense
    assert model == {
        "device": "cpu",
        "dtype": "float32",
        "batched": True,
        "batch_invariant": True,  # the default: reuse and batching never change an answer
        "attention": "exact (kernel)",  # built with the machine's C++ compiler (exact_kernel.py)
        "compiled": "off",  # the default (tests/test_compiled_step.py turns it on)
        "cuda_graphs": "off",  # CUDA only
        "kv_pages": 16 * 8192 // 256,  # max_running whole contexts (address space: taken as written)
        "page_tokens": 256,  # the store's chunk
        "kv_pool_tokens": 16 * 8192,
    }


async def test_queue_full_a_miss_goes_upstream_and_a_hit_takes_a_waiting_misss_place(
    local_proxy, fake_upstream
):
    """Cost-aware routing with a bounded queue: at a full queue a miss goes upstream at once, and a hit
    takes the place of the miss waiting in the queue, which goes upstream instead; the hit is served
    locally from its stored KV."""
    server = local_proxy(local_runner={"max_queue": 1, "max_running": 1}, llm_endpoint={"model": MODEL})
    url = server.url + "/v1/chat/completions"
    first = [{"role": "user", "content": "Name a color."}]
    long = LONG_STREAM
    async with aiohttp.ClientSession() as http:
        turn1 = await http.post(
            url, json={"model": MODEL, "messages": first, "max_tokens": 4, "temperature": 0}
        )
        answer = (await turn1.json())["choices"][0]["message"]["content"]
        second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Another?"}]
        running = await http.post(url, json={**long, "ignore_eos": True})
        # New conversations far longer than the system prompt they share: mostly to compute, misses.
        topic = "Tell me about rivers, mountains, deserts and oceans of every continent. " * 8
        other = "Explain how bridges, tunnels, dams and towers are built, step by step. " * 8
        waiting_body = {
            **long,
            "messages": [{"role": "user", "content": other}],
            "max_tokens": 2,
            "stream": False,
        }
        waiting = asyncio.ensure_future(http.post(url, json=waiting_body))
        await async_wait_until(lambda: runner_is(http, server.url, queued=1), "the queue full", 30)
        miss = await http.post(url, json={**long, "messages": [{"role": "user", "content": topic}]})
        assert miss.headers["X-AttentionStore-Route"] == "upstream" and len(fake_upstream.requests) == 1
        hit = asyncio.ensure_future(
            http.post(url, json={"model": MODEL, "messages": second, "max_tokens": 2, "temperature": 0})
        )
        displaced = await asyncio.wait_for(waiting, 60)  # the waiting miss gave its place to the hit
        assert displaced.status == 200 and displaced.headers["X-AttentionStore-Route"] == "upstream"
        assert len(fake_upstream.requests) == 2 and not hit.done()
        running.close()
        served = await hit
        assert served.status == 200 and served.headers["X-AttentionStore-Route"] == "local"
        assert served.headers["X-AttentionStore-Cache"] != "miss"
