"""Positional decoupling end to end: the real model behind the proxy, a 512-token context.

A conversation grows until the proxy drops its oldest turns; that turn reuses the kept turns' stored KV
moved down by T positions (X-AttentionStore-Position-Shift: T), the next turn is a plain hit on the saved
truncated sequence, `decouple: false` recomputes, and another tenant never matches.
"""

from __future__ import annotations

import logging

import orjson
import pytest
import urllib3

from tests.test_reuse import chat, local_proxy  # noqa: F401 - the fixture, used by name

pytestmark = pytest.mark.model

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}
TOPICS = ["rivers", "mountains", "deserts", "forests", "oceans", "islands", "glaciers", "volcanoes"]
SMALL_CONTEXT = {"position_encoding": {"max_context_tokens": 512}}


def user(i: int) -> dict:
    topic = TOPICS[i % len(TOPICS)]
    text = (
        f"Question {i}. I am writing a long school report about {topic} and I would like to get the facts "
        f"right before I hand it in next week. My teacher asked for the most important things to know about "
        f"{topic}, how they form, where the largest ones are, and why they matter to people who live near "
        f"them. What is the single most important fact about {topic}?"
    )
    return {"role": "user", "content": text}


def shift_of(headers) -> int:
    return int(headers["X-AttentionStore-Position-Shift"])


def grow_until_truncated(server) -> tuple[list[dict], list[dict], tuple]:
    """Turns with the model's own answers until one is served with a position shift; returns the history
    of the turn before it, the truncating turn's messages and its (answer, headers, usage)."""
    history = [SYSTEM]
    before: list[dict] = []
    for i in range(10):
        history.append(user(i))
        answer, headers, usage = chat(server, history)
        if shift_of(headers):
            return before, list(history), (answer, headers, usage)
        before = list(history)
        history.append({"role": "assistant", "content": answer})
    raise AssertionError("no turn was truncated")


def test_an_overflowing_conversation_reuses_its_kept_turns_moved(local_proxy, smollm, tmp_path, caplog):  # noqa: F811
    server = local_proxy(attention_store=SMALL_CONTEXT)
    with caplog.at_level(logging.INFO, logger="attnstore"):
        before, truncating, (answer, headers, usage) = grow_until_truncated(server)
    system_tokens = len(smollm.tokenizer.apply_chat_template([SYSTEM], tokenize=True, return_dict=False))
    reused = int(headers["X-AttentionStore-Reused-Tokens"])
    assert answer.strip()
    assert reused > system_tokens + 32, (reused, system_tokens)  # the kept turns, not only the system prompt
    assert usage.prompt_tokens + 16 <= 512 and usage.prompt_tokens_details.cached_tokens == reused
    assert any(f"shift={shift_of(headers)}" in r.getMessage() for r in caplog.records)

    # The next turn (whole history again) finds the same cut: a plain hit on the saved truncated sequence.
    following = [*truncating, {"role": "assistant", "content": answer}, user(50)]
    _, next_headers, next_usage = chat(server, following)
    assert shift_of(next_headers) == 0 and next_headers["X-AttentionStore-Cache"] == "l0_hit"
    assert int(next_headers["X-AttentionStore-Reused-Tokens"]) >= usage.prompt_tokens

    stats = orjson.loads(
        urllib3.request(
            "GET", server.url + "/v1/attention_store/stats", headers={"Authorization": "Bearer key-a"}
        ).data
    )
    assert stats["runner"]["shifted_turns"] == 1 and stats["runner"]["shifted_tokens"] > 0

    # Another tenant with the same session id and messages never matches this tenant's KV.
    _, other, other_usage = chat(server, truncating, key="key-b")
    assert other["X-AttentionStore-Cache"] == "miss" and shift_of(other) == 0
    assert other_usage.prompt_tokens_details.cached_tokens == 0

    # decouple: false recomputes the truncated turn after its system prompt (its own disk: no sharing).
    recompute = local_proxy(
        attention_store={
            "position_encoding": {**SMALL_CONTEXT["position_encoding"], "decouple": False},
            "tiering": {"l2_disk": {"path": str(tmp_path / "kv-recompute")}},
        }
    )
    chat(recompute, before)
    answer_r, headers_r, usage_r = chat(recompute, truncating)
    assert answer_r.strip() and shift_of(headers_r) == 0
    assert int(headers_r["X-AttentionStore-Reused-Tokens"]) < system_tokens + 16
    assert usage_r.prompt_tokens == usage.prompt_tokens  # the same cut
