"""Issues 13 and 18 with the local model: an oversized prompt is refused before tokenizing, one client may
use idle capacity, clients share the queue fairly, and the engine refuses past running + queue (issue 18)."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from proxy.serving import prompts
from proxy.turns.local_start import local_engine
from tests.model_fixture import MODEL
from tests.servers import http_request

pytestmark = pytest.mark.model

URL = "/v1/chat/completions"


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(local_proxy, fake_upstream, monkeypatch):
    server = local_proxy()  # with an upstream: big bodies may be its (images), so they are read
    calls = []
    real = prompts.fit_turn

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(prompts, "fit_turn", counting)
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
    engine = local_engine(server.app)
    limit = engine.context_limit(MODEL) * 64 + 64 * 1024
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "a" * (limit + 1)}], "max_tokens": 2}
    r = http_request("POST", server.url + URL, huge, timeout=60)
    assert r.status == 413 and r.json()["error"]["code"] == "request_too_large"
    fits = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 2000}], "max_tokens": 2}
    assert http_request("POST", server.url + URL, fits, timeout=60).status == 200


async def statuses_of(server, bodies: list[dict], headers: dict | None = None) -> list[int]:
    """Send every body at once, streamed; each client leaves as soon as it has its status (a served
    stream's headers come with its first token), so a queued job runs as soon as the one before it
    was served and left."""

    async def one(s: aiohttp.ClientSession, body: dict) -> int:
        async with s.post(server.url + URL, json={**body, "stream": True}, headers=headers) as r:
            return r.status

    async with aiohttp.ClientSession() as s:
        return list(await asyncio.gather(*(one(s, b) for b in bodies)))


async def until(condition, timeout_s: float = 30.0) -> None:
    """Wait for a condition on the server's state, polled: a fixed sleep is a race on a slow machine."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting for the server"
        await asyncio.sleep(0.02)


def counting(i: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Count from one to one thousand, run {i}."}],
        "max_tokens": 300,
        "ignore_eos": True,  # vLLM's extension: the answer runs to max_tokens, so a job holds its slot
    }


async def test_one_client_with_twelve_conversations_is_served_whole(local_proxy):
    """No request is refused while a running slot or a queue place is free, whoever holds the others:
    one client (one key) with 12 conversations at once and max_running 4 + max_queue 16 gets 12 x 200."""
    server = local_proxy(local_runner={"max_running": 4, "max_queue": 16})
    bodies = [
        {"model": MODEL, "messages": [{"role": "user", "content": f"Name river {i}."}], "max_tokens": 3}
        for i in range(12)
    ]
    assert await statuses_of(server, bodies, {"Authorization": "Bearer one-app"}) == [200] * 12


async def test_past_running_plus_queue_the_rest_get_503_hits_and_misses_alike(local_proxy):
    """max_running 1 + max_queue 2: of 10 conversations at once, 3 are served and 7 refused at once (no
    upstream here); the same bound holds for 10 identical turns whose prefix is stored (hits wait in
    the same queue, counted)."""
    server = local_proxy(local_runner={"max_queue": 2, "max_running": 1})
    different = await statuses_of(server, [counting(i) for i in range(10)])
    assert sorted(different) == [200] * 3 + [503] * 7, different
    first = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to ten."}],
        "max_tokens": 8,
    }
    r = http_request("POST", server.url + URL, first, timeout=60)
    assert r.status == 200
    turn2 = {
        "model": MODEL,
        "max_tokens": 300,
        "ignore_eos": True,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Now count from one to one thousand."},
        ],
    }
    hits = await statuses_of(server, [turn2] * 10)
    assert sorted(hits) == [200] * 3 + [503] * 7, hits


async def test_a_client_past_its_share_gets_429_with_retry_after_while_another_waits(local_proxy):
    server = local_proxy(local_runner={"max_queue": 2, "max_running": 1})
    a = {"Authorization": "Bearer client-a"}
    async with aiohttp.ClientSession() as s:
        running = await s.post(server.url + URL, json={**counting(0), "stream": True}, headers=a)
        assert running.status == 200  # A's first runs; A's next two fill the queue
        engine = local_engine(server.app)
        queued = []
        for i in (1, 2):  # one after the other, so which is A's newest is not left to the network
            queued.append(
                asyncio.ensure_future(
                    s.post(server.url + URL, json={**counting(i), "stream": True}, headers=a)
                )
            )
            await until(lambda n=i: len(engine.scheduler.window()) == n)
        b = {"Authorization": "Bearer client-b"}
        b_task = asyncio.ensure_future(
            s.post(server.url + URL, json={**counting(3), "stream": True}, headers=b)
        )
        displaced = await asyncio.wait_for(queued[1], 60)  # A's newest gives its place to B
        assert displaced.status == 429 and int(displaced.headers["Retry-After"]) >= 1
        assert orjson.loads(await displaced.read())["error"]["code"] == "rate_limit_exceeded"
        running.close()  # A's first ends; A's second, then B's, are served
        for task in (queued[0], b_task):
            r = await asyncio.wait_for(task, 120)
            assert r.status == 200
            r.close()
