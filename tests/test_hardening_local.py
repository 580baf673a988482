"""Issue 13 with the local model: an oversized prompt is refused before tokenizing, one client cannot
hold more than max_concurrent_per_client local requests, and the runner refuses past running + queue."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from proxy.keys import LOCAL_BACKEND
from tests.model_fixture import MODEL
from tests.servers import http_request

pytestmark = pytest.mark.model

URL = "/v1/chat/completions"


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(local_proxy, fake_upstream):
    server = local_proxy()  # with an upstream: big bodies may be its (images), so they are read
    runner = server.app[LOCAL_BACKEND].runner
    calls = []
    real = runner.render_turn if hasattr(runner, "render_turn") else runner.render
    name = "render_turn" if hasattr(runner, "render_turn") else "render"

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    setattr(runner, name, counting)
    # 2 M characters: more than 81 characters per token (SmolLM2's longest token) times 8192 tokens.
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "a" * 2_000_000}], "max_tokens": 2}
    r = http_request("POST", server.url + URL, huge, timeout=60)
    assert r.status == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert calls == []  # refused on characters alone: the tokenizer never saw it
    small = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert http_request("POST", server.url + URL, small, timeout=60).status == 200
    assert calls == [1]


def test_without_an_upstream_an_oversized_body_is_refused_before_it_is_read(local_proxy):
    server = local_proxy()
    runner = server.app[LOCAL_BACKEND].runner
    limit = runner.context_limit(MODEL) * 64 + 64 * 1024
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "a" * (limit + 1)}], "max_tokens": 2}
    r = http_request("POST", server.url + URL, huge, timeout=60)
    assert r.status == 413 and r.json()["error"]["code"] == "request_too_large"
    fits = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 2000}], "max_tokens": 2}
    assert http_request("POST", server.url + URL, fits, timeout=60).status == 200


async def test_one_client_gets_at_most_max_concurrent_per_client_local_requests(local_proxy):
    server = local_proxy(proxy={"max_concurrent_per_client": 1})
    long = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 400,
        "stream": True,
    }
    short = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + URL, json=long, headers={"Authorization": "Bearer a"}) as held:
            assert held.status == 200
            await held.content.readline()  # the first event: the job is running
            async with s.post(server.url + URL, json=short, headers={"Authorization": "Bearer a"}) as r:
                assert r.status == 429
                assert orjson.loads(await r.read())["error"]["code"] == "too_many_concurrent_requests"
            async with s.post(server.url + URL, json=short, headers={"Authorization": "Bearer b"}) as r:
                assert r.status == 200  # another client is served
        # once the first has ended, the client may send again
        async with s.post(server.url + URL, json=short, headers={"Authorization": "Bearer a"}) as r:
            assert r.status == 200


async def test_past_running_plus_queue_the_rest_get_503_at_once(local_proxy):
    server = local_proxy(
        local_runner={"max_queue": 1, "max_running": 1}, proxy={"max_concurrent_per_client": 0}
    )
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 200,
    }

    async def one(s: aiohttp.ClientSession, i: int) -> int:
        payload = {**body, "messages": [{"role": "user", "content": f"Story {i}, please."}]}
        async with s.post(server.url + URL, json=payload) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as s:
        statuses = await asyncio.gather(*(one(s, i) for i in range(6)))
    # max_running 1 + max_queue 1: two in flight, the other four refused at once (no upstream here)
    assert set(statuses) <= {200, 503} and statuses.count(200) <= 2 and statuses.count(503) >= 4
