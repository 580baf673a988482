"""The legacy Completions API and the Responses API served locally with reuse (issue 26): the official
openai client, the proxy over loopback HTTP, the real model (float32: reuse equals recompute there).

- a completion that extends an earlier prompt + answer reuses its KV, and answers like a recompute;
- a Responses follow-up that sends only its new input (`previous_response_id`) is an l0_hit whose
  greedy answer equals a chat completion of the same conversation; the stream is the documented event
  sequence; another tenant's id is a 404; GET and DELETE; after a restart with Redis as the index the
  follow-up is served from L2.
"""

from __future__ import annotations

import openai
import pytest

from tests.model_fixture import MODEL
from tests.servers import http_request

pytestmark = pytest.mark.model

SMALL_CHUNKS = {"kv_chunk_tokens": 16}
QUESTION = "Name three colors."
FOLLOW_UP = "Which of them is the warmest?"


@pytest.fixture
def serve(local_proxy):
    """start(**sections): the proxy on the real model with 16-token KV chunks (short prompts hit)."""

    def start(**sections):
        lr = {**SMALL_CHUNKS, **sections.pop("local_runner", {})}
        return local_proxy(local_runner=lr, **sections)

    return start


def client(server, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def complete(server, prompt: str, *, stream: bool = False, enabled_reuse: bool = True, **extra):
    """One greedy completion: (text, headers, usage)."""
    kwargs = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, **extra)
    c = client(server)
    if not stream:
        raw = c.completions.with_raw_response.create(**kwargs)
        body = raw.parse()
        assert body.object == "text_completion" and body.choices[0].index == 0
        return body.choices[0].text, raw.headers, body.usage
    raw = c.completions.with_raw_response.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    parts, usage, reasons = [], None, []
    for chunk in raw.parse():
        for choice in chunk.choices:
            parts.append(choice.text)
            reasons.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    return "".join(parts), raw.headers, usage


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_completion_that_extends_the_last_one_reuses_its_kv_and_answers_like_a_recompute(serve, stream):
    server = serve()
    prompt = "The capital of France is Paris. The capital of Italy is"
    text, headers, usage = complete(server, prompt, stream=stream)
    assert headers["X-AttentionStore-Route"] == "local" and headers["X-AttentionStore-Cache"] == "miss"
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    longer = prompt + text + " The capital of Spain is"
    again, headers2, usage2 = complete(server, longer, stream=stream)
    reused = int(headers2["X-AttentionStore-Reused-Tokens"])
    assert headers2["X-AttentionStore-Cache"] == "l0_hit" and reused >= 16
    assert usage2.prompt_tokens_details.cached_tokens == reused
    # The same session without a session id: the prompt's start names it.
    assert headers2["X-AttentionStore-Session"] == headers["X-AttentionStore-Session"]
    fresh = serve(attention_store={"enabled": False})
    recomputed, headers3, _ = complete(fresh, longer, stream=stream)
    assert headers3["X-AttentionStore-Cache"] == "miss" and recomputed == again


def test_a_completion_of_token_ids_and_bad_completions(serve):
    server = serve()
    c = client(server)
    ids = c.completions.create(model=MODEL, prompt=[504, 3458, 282], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.choices[0].finish_reason in ("stop", "length")
    r = http_request("POST", server.url + "/v1/completions", {"model": MODEL, "prompt": [10**9]})
    assert r.status == 400 and r.json()["error"]["param"] == "prompt"
    r = http_request("POST", server.url + "/v1/completions", {"model": MODEL})
    assert r.status == 400 and r.json()["error"]["param"] == "prompt"
    # Not served locally, and no upstream: a clear 400 naming why.
    r = http_request("POST", server.url + "/v1/completions", {"model": MODEL, "prompt": "a", "echo": True})
    assert r.status == 400 and "echo" in r.json()["error"]["message"]


def respond(server, key: str = "key-a", **kwargs):
    raw = client(server, key).responses.with_raw_response.create(model=MODEL, temperature=0, **kwargs)
    return raw.parse(), raw.headers


def chat_answer(server, messages) -> str:
    fresh = client(server).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16, extra_body={"session_id": "recompute"}
    )
    return fresh.choices[0].message.content


def test_a_responses_follow_up_sends_only_its_input_reuses_the_kv_and_answers_like_chat(serve):
    server = serve()
    first, headers = respond(server, input=QUESTION, instructions="Be brief.", max_output_tokens=16)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert headers["X-AttentionStore-Session"] == first.id and first.id.startswith("resp_")
    assert first.usage.input_tokens > 0 and first.usage.input_tokens_details.cached_tokens == 0
    second, headers2 = respond(server, input=FOLLOW_UP, previous_response_id=first.id, max_output_tokens=16)
    assert headers2["X-AttentionStore-Cache"] == "l0_hit"
    reused = int(headers2["X-AttentionStore-Reused-Tokens"])
    assert reused > 0 and second.usage.input_tokens_details.cached_tokens == reused
    assert second.previous_response_id == first.id
    # The instructions are not carried over; the conversation is.
    conversation = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": FOLLOW_UP},
    ]
    recompute = serve(attention_store={"enabled": False})
    assert second.output_text == chat_answer(recompute, conversation)
    # GET returns the stored response; DELETE forgets it and its KV, and a follow-up is then a 404.
    got = client(server).responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    client(server).responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client(server).responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        respond(server, input="And?", previous_response_id=second.id)


def test_another_tenants_previous_response_id_is_a_404(serve):
    server = serve()
    mine, _ = respond(server, key="key-a", input=QUESTION, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError) as refused:
        respond(server, key="key-b", input=FOLLOW_UP, previous_response_id=mine.id, max_output_tokens=4)
    assert (refused.value.body["code"], refused.value.body["param"]) == (
        "previous_response_not_found",
        "previous_response_id",
    )
    with pytest.raises(openai.NotFoundError):
        client(server, "key-b").responses.retrieve(mine.id)
    assert client(server, "key-a").responses.retrieve(mine.id).id == mine.id


def test_truncation_is_the_requests_own_a_conversation_past_the_context_is_a_400_unless_auto(serve):
    """Responses' `truncation`: "disabled" (OpenAI's default) refuses a conversation past the model's
    context (400 context_length_exceeded); "auto" drops its oldest turns and answers; the response
    echoes the value it ran with; anything else is a 400 naming it."""
    server = serve()
    long_turns = [
        {"role": "user", "content": "word " * 4500},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "word " * 4500},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Say hi."},
    ]  # about 9,000 tokens: past SmolLM2's 8,192
    for truncation in (None, "disabled"):
        extra = {"truncation": truncation} if truncation else {}
        with pytest.raises(openai.BadRequestError) as refused:
            respond(server, input=long_turns, max_output_tokens=2, **extra)
        assert refused.value.body["code"] == "context_length_exceeded"
    answered, _ = respond(server, input=long_turns, max_output_tokens=2, truncation="auto")
    assert answered.truncation == "auto" and answered.status in ("completed", "incomplete")
    assert answered.usage.input_tokens < 8192
    short, _ = respond(server, input=QUESTION, max_output_tokens=2)
    assert (short.truncation, short.tool_choice, short.parallel_tool_calls) == ("disabled", "auto", True)
    with pytest.raises(openai.BadRequestError) as bad:
        respond(server, input=QUESTION, max_output_tokens=2, truncation="sometimes")
    assert bad.value.body["param"] == "truncation"


def test_chat_only_fields_on_a_local_responses_turn_are_openais_unknown_parameter(serve):
    """Fields of Chat Completions that OpenAI's Responses API lacks (`seed`, `stop`, `max_tokens`,
    penalties...) get OpenAI's 400 `unknown_parameter` naming the field, so a request that works here
    works at OpenAI too; vLLM's extension `top_k` is served."""
    server = serve()
    for field, value in (("seed", 1), ("stop", ["."]), ("max_tokens", 4), ("presence_penalty", 0.5)):
        with pytest.raises(openai.BadRequestError) as refused:
            respond(server, input=QUESTION, max_output_tokens=2, extra_body={field: value})
        body = refused.value.body
        assert (body["code"], body["param"], body["type"]) == (
            "unknown_parameter",
            field,
            "invalid_request_error",
        )
        assert body["message"] == f"Unknown parameter: '{field}'."
    answered, _ = respond(server, input=QUESTION, max_output_tokens=2, extra_body={"top_k": 1})
    assert answered.status in ("completed", "incomplete") and answered.output_text


def test_the_responses_stream_is_the_documented_event_sequence(serve):
    server = serve()
    c = client(server)
    with c.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=12) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[:4] == head and kinds[-4:-1] == tail
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = kinds[4:-4]
    assert deltas and set(deltas) == {"response.output_text.delta"}
    stored = c.responses.retrieve(final.id)
    assert final.output_text and stored.output_text == final.output_text
    plain, _ = respond(server, input=QUESTION, max_output_tokens=12, store=False)
    assert plain.output_text == final.output_text  # streamed or not, the same greedy answer
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(plain.id)  # store: false keeps nothing


@pytest.mark.redis
def test_a_follow_up_after_a_restart_with_redis_is_served_from_l2(serve, redis_server, tmp_path):
    sections = {
        "proxy": {"session_index": redis_server.url},
        "attention_store": {"tiering": {"l2_disk": {"path": str(tmp_path / "shared-kv")}}},
    }
    first_server = serve(**sections)
    first, _ = respond(first_server, input=QUESTION, max_output_tokens=12)
    first_server.stop()  # its L2 writes finish as it stops
    again = serve(**sections)
    second, headers = respond(again, input=FOLLOW_UP, previous_response_id=first.id, max_output_tokens=12)
    assert headers["X-AttentionStore-Cache"] == "l2_hit"
    assert second.usage.input_tokens_details.cached_tokens > 0
