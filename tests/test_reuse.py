"""Attention reuse end to end: the official openai client, the proxy over loopback HTTP, the real model.

Every hit level is checked against a recompute of the same prompt (enabled: false) token for token.
"""

from __future__ import annotations

import logging

import openai
import orjson
import pytest
import urllib3

from proxy.http.app import build_full_app
from tests.model_fixture import MODEL

pytestmark = pytest.mark.model

FIRST = "Name three colors."
SECOND = "Which of them is the warmest?"
TINY_CHUNKS = {"kv_chunk_tokens": 16}


@pytest.fixture
def local_proxy(start_app, make_settings, smollm):
    """start(**sections) -> AppServer: the proxy serving the real model locally, with these settings."""

    def start(**sections):
        lr = {"enabled": True, **TINY_CHUNKS, **sections.pop("local_runner", {})}
        settings = make_settings(local_runner=lr, **sections)
        return start_app(build_full_app(settings, models={MODEL: smollm}))

    return start


def client(server, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat(server, messages, *, key: str = "key-a", session: str | None = "s1", stream: bool = False):
    """One greedy turn; returns (answer text, response headers, usage)."""
    extra = {"session_id": session} if session else None
    kwargs = dict(model=MODEL, messages=messages, temperature=0, max_tokens=16, extra_body=extra)
    c = client(server, key)
    if not stream:
        raw = c.chat.completions.with_raw_response.create(**kwargs)
        body = raw.parse()
        return body.choices[0].message.content, raw.headers, body.usage
    raw = c.chat.completions.with_raw_response.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    text, usage = [], None
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    return "".join(text), raw.headers, usage


def second_turn(answer: str) -> list[dict]:
    """Turn 1's messages: turn 0, its real answer, the next question."""
    return [
        {"role": "user", "content": FIRST},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": SECOND},
    ]


def two_turns(server, **kw):
    """Turn 0, then turn 1 carrying turn 0's real answer; returns both (answer, headers, usage)."""
    first = chat(server, [{"role": "user", "content": FIRST}], **kw)
    history = second_turn(first[0])
    return first, chat(server, history, **kw), history


def recompute(local_proxy, history) -> str:
    baseline = local_proxy(attention_store={"enabled": False})
    answer, headers, usage = chat(baseline, history)
    assert headers["X-AttentionStore-Cache"] == "miss" and usage.prompt_tokens_details.cached_tokens == 0
    return answer


def wait_saved(server) -> dict:
    """Block until the proxy's L2 writes are done (the response never waits for the disk)."""
    import time

    for _ in range(200):
        stats = orjson.loads(urllib3.request("GET", server.url + "/v1/attention_store/stats").data)
        if stats["saves_pending"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError("saves still pending")


@pytest.mark.parametrize("stream", [False, True])
def test_second_turn_is_an_l0_hit_with_the_recompute_answer(local_proxy, stream, caplog):
    server = local_proxy()
    with caplog.at_level(logging.INFO, logger="attnstore"):
        (a0, h0, u0), (a1, h1, u1), history = two_turns(server, stream=stream)
    assert h0["X-AttentionStore-Cache"] == "miss" and h0["X-AttentionStore-Route"] == "local"
    assert h0["X-AttentionStore-Reused-Tokens"] == "0"
    assert h1["X-AttentionStore-Cache"] == "l0_hit"
    reused = int(h1["X-AttentionStore-Reused-Tokens"])
    # Everything of turn 0 (prompt + answer) but the few tokens the template adds after it.
    assert u0.prompt_tokens + u0.completion_tokens - 2 <= reused < u1.prompt_tokens
    assert u1.prompt_tokens_details.cached_tokens == reused
    assert float(h1["X-AttentionStore-TTFT-Ms"]) > 0
    assert h1["X-AttentionStore-Session"] == "s1"
    assert h0["X-AttentionStore-Tiers"] == "l0=0,l1=0,l2=0"
    assert h1["X-AttentionStore-Tiers"] == f"l0={reused},l1=0,l2=0"
    assert h1["X-AttentionStore-Position-Shift"] == "0" and h1["X-AttentionStore-Replica"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[AttentionStore]")]
    assert any("session=s1 turn=0 miss reused=0" in line for line in lines)
    assert any(
        f"session=s1 turn=1 l0_hit reused={reused} prompt={u1.prompt_tokens}" in line for line in lines
    )
    assert a1 == recompute(local_proxy, history)


def test_l1_hit_when_l0_has_no_room(local_proxy):
    server = local_proxy(attention_store={"tiering": {"l0_gpu": {"capacity_mb": 0}}})
    _, (a1, h1, _), history = two_turns(server)
    assert h1["X-AttentionStore-Cache"] == "l1_hit"
    assert a1 == recompute(local_proxy, history)


def test_l2_hit_when_only_the_disk_has_room(local_proxy):
    server = local_proxy(
        attention_store={"tiering": {"l0_gpu": {"capacity_mb": 0}, "l1_host": {"capacity_mb": 0}}}
    )
    first = chat(server, [{"role": "user", "content": FIRST}])
    wait_saved(server)
    history = second_turn(first[0])
    a1, h1, u1 = chat(server, history)
    assert h1["X-AttentionStore-Cache"] == "l2_hit"
    assert u1.prompt_tokens_details.cached_tokens > 0
    reused = u1.prompt_tokens_details.cached_tokens
    assert h1["X-AttentionStore-Tiers"] == f"l0=0,l1=0,l2={reused}"
    assert a1 == recompute(local_proxy, history)


def test_restart_on_the_same_disk_is_an_l2_hit(local_proxy):
    server = local_proxy()
    first = chat(server, [{"role": "user", "content": FIRST}])
    wait_saved(server)
    server.stop()
    restarted = local_proxy()
    history = second_turn(first[0])
    a1, h1, _ = chat(restarted, history)
    assert h1["X-AttentionStore-Cache"] == "l2_hit"
    assert a1 == recompute(local_proxy, history)


def test_another_key_never_reuses_the_first_keys_kv(local_proxy):
    server = local_proxy()
    (_, _, _), (_, h1, _), history = two_turns(server, key="key-a")
    assert h1["X-AttentionStore-Cache"] == "l0_hit"
    _, other, usage = chat(server, history, key="key-b")
    assert other["X-AttentionStore-Cache"] == "miss" and usage.prompt_tokens_details.cached_tokens == 0


def test_no_session_id_still_hits(local_proxy):
    server = local_proxy()
    (_, h0, _), (_, h1, _), _ = two_turns(server, session=None)
    assert h1["X-AttentionStore-Cache"] == "l0_hit"
    assert h0["X-AttentionStore-Session"] == h1["X-AttentionStore-Session"]  # derived from the prefix


def test_forgetting_a_session_drops_its_kv(local_proxy):
    server = local_proxy()
    first = chat(server, [{"role": "user", "content": FIRST}])
    wait_saved(server)
    deleted = urllib3.request(
        "DELETE", server.url + "/v1/attention_store/sessions/s1", headers={"Authorization": "Bearer key-a"}
    )
    assert deleted.status == 200 and orjson.loads(deleted.data)["chunks"] > 0
    history = [{"role": "user", "content": FIRST}, {"role": "assistant", "content": first[0]}]
    _, headers, _ = chat(server, [*history, {"role": "user", "content": SECOND}])
    assert headers["X-AttentionStore-Cache"] == "miss"


def test_stats_and_metrics_report_the_store(local_proxy):
    server = local_proxy()
    two_turns(server)
    stats = wait_saved(server)
    assert stats["tiers"]["l0"]["entries"] > 0 and stats["tiers"]["l2"]["entries"] > 0
    assert stats["hits"]["l0"] >= 1 and stats["misses"] >= 1 and stats["bytes_saved"] > 0
    assert stats["tiers"]["l0"]["used_bytes"] <= stats["tiers"]["l0"]["capacity_bytes"]
    text = urllib3.request("GET", server.url + "/metrics").data.decode()
    assert 'attnstore_chat_requests_total{cache="l0_hit",route="local"} 1.0' in text
    assert 'attnstore_ttft_seconds_count{cache="miss"} 1.0' in text
    assert "attnstore_tier_used_bytes" in text and "attnstore_reused_tokens_total" in text
    assert stats["runner"]["admitted"] == 2 and 0 <= stats["runner"]["queue_wait_seconds"] < 60
    reused = stats["reused_tokens"]["l0"]
    assert reused > 0 and stats["reused_tokens"]["l2"] == 0
    assert f'attnstore_store_reused_tokens_total{{model="{MODEL}",tier="l0"}} {float(reused)}' in text
    assert f'attnstore_prefetch_chunks_total{{model="{MODEL}",outcome="issued"}} 0.0' in text


def sharegpt_conversations(count: int, min_turns: int):
    """The first `count` complete ShareGPT conversations with `min_turns` user turns (read lazily)."""
    from bench.sharegpt import default_path, iter_json_array, to_conversation

    found = []
    for obj in iter_json_array(default_path()):
        conv = to_conversation(obj)
        if conv is not None and conv.turns >= min_turns:
            found.append(conv)
            if len(found) == count:
                return found
    raise AssertionError("not enough ShareGPT conversations")


def test_sharegpt_turns_reuse_nearly_everything_and_answer_like_recompute(local_proxy, smollm):
    """Real conversations: the client resends the answer as text, the template re-tokenizes it, and the
    stored KV must still cover (almost) all of the previous prompt + answer, with identical answers."""
    from bench.sharegpt import cap_text

    reuse = local_proxy()
    recompute = local_proxy(attention_store={"enabled": False})
    ratios, reused_vs_prompt = [], []
    for n, conv in enumerate(sharegpt_conversations(2, 3)):
        history: list[dict] = []
        previous: tuple[int, int] | None = None
        for text in conv.user_messages[:3]:
            history.append({"role": "user", "content": cap_text(smollm.tokenizer, text, 48)})
            answer, headers, usage = chat(reuse, history, session=f"sharegpt-{n}")
            expected, _, _ = chat(recompute, history, session=f"sharegpt-{n}")
            assert answer == expected
            reused = int(headers["X-AttentionStore-Reused-Tokens"])
            if previous:
                ratios.append(reused / (previous[0] + previous[1]))
                reused_vs_prompt.append(reused - previous[0])
            previous = (usage.prompt_tokens, usage.completion_tokens)
            history.append({"role": "assistant", "content": answer})
    # The whole previous prompt is always reused; of the answer, everything up to the first token the
    # template re-tokenizes differently (the model may emit "Bre"+"ndon" where BPE gives "B"+"rend"+"on").
    assert len(ratios) == 4 and min(reused_vs_prompt) >= 0, (ratios, reused_vs_prompt)
    assert sum(ratios) / len(ratios) >= 0.9, ratios
