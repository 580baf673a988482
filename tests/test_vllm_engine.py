"""attnstore on real vLLM (local_runner.engine "vllm"): `python -m proxy serve` processes, each starting
vLLM CPU with attnstore's connector and vLLM's own prefix cache off, so every reused token comes from the
store. Greedy answers must equal vLLM recomputing the same prompt (the same server, the store not
consulted), in bfloat16 and float32 (the CPU kernel lays KV out differently in each) and at the default
dtype; a restart of attnstore and vLLM keeps the hits (from L2); a corrupt L2 file is a miss;
DELETE forgets; two replicas with a Redis index share the L2 folder.

They need a Python with vLLM 0.32 (`make vllm` builds .venv-vllm; ATTNSTORE_TEST_VLLM_PYTHON names
another) and skip, saying so, without one. vLLM takes about a minute to start here (-O0: no
compilation), so each test starts only the servers it needs, and the default dtype's checks share two
starts.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest
import urllib3
from transformers import AutoTokenizer

from engine_api.model_source import ModelLoadError
from engine_api.prompt import PromptFormat, render_prompt
from tests import test_agents as agents
from tests import test_responses_tools as responses_tools
from tests.model_fixture import DEFAULT_DTYPE, MODEL, REPO
from tests.support import tools as shared_tools
from tests.support.processes import ReplicaProcess
from tests.support.waiting import wait_until
from vllm_engine.server import check_vllm_python

pytestmark = pytest.mark.model
# Absolute (not resolved: a venv's python is a link), as the servers start in temporary folders.
VLLM_PYTHON = os.path.abspath(
    os.environ.get("ATTNSTORE_TEST_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
)
START_S = 600  # two vLLMs starting at once on two cores
QUESTIONS = [
    "Explain what the KV cache does during inference, in a few sentences.",
    "How does it relate to the cost of multi-turn chats?",
    "Summarize both answers in one line.",
]
OTHER_QUESTIONS = ["Name three programming languages and what each is used for.", "Which one is the oldest?"]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.skip(f"no vLLM Python at {VLLM_PYTHON} (make vllm, or set ATTNSTORE_TEST_VLLM_PYTHON)")
    try:
        check_vllm_python(VLLM_PYTHON)
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    return VLLM_PYTHON


def settings(
    python: str, l2: Path, *, index: str = "memory", name: str = "a", dtype: str | None = None
) -> dict[str, Any]:
    """`dtype` None: the default (`auto`: bfloat16 where the CPU computes it natively, else float32)."""
    return {
        "attention_store": {
            "tiering": {
                "l0_gpu": {"capacity_mb": 512},
                "l1_host": {"capacity_mb": 256},
                "l2_disk": {"path": str(l2)},
            },
            "position_encoding": {"decouple": False, "max_context_tokens": 2048},
            "scheduler_aware": {"evict_on_pressure": False},
        },
        "local_runner": {
            "engine": "vllm",
            "vllm_python": python,
            **({"dtype": dtype} if dtype else {}),
            "cache_dir": str(REPO / "var" / "models"),
            "kv_chunk_tokens": 128,
            "vllm_args": ["-O0", "--no-enable-prefix-caching"],
        },
        "proxy": {"session_index": index, "replica_id": name},
    }


class Servers:
    """attnstore replicas started by one test; stopped (and every vLLM they started ended) at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[ReplicaProcess] = []
        self.count = 0

    def start(self, *configs: dict[str, Any]) -> list[ReplicaProcess]:
        new = []
        for config in configs:
            self.count += 1
            new.append(ReplicaProcess(self.tmp, f"{config['proxy']['replica_id']}-{self.count}", config))
        self.started += new
        return [r.wait_ready(START_S) for r in new]

    def stop(self) -> None:
        for r in self.started:
            r.stop()
        self.started = []
        for pid in _pids_mentioning(str(self.tmp)):  # a vLLM its proxy could not stop: ours, by its L2 path
            os.kill(pid, signal.SIGKILL)


def _pids_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture
def servers(tmp_path: Path, vllm_python: str) -> Iterator[Servers]:
    s = Servers(tmp_path)
    try:
        yield s
    finally:
        s.stop()
    assert _pids_mentioning(str(tmp_path)) == [], "a vLLM outlived its proxy"


def chat(
    url: str, messages: list[dict[str, str]], session: str
) -> tuple[str, dict[str, str], dict[str, Any]]:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 24}
    resp = urllib3.request(
        "POST",
        url + "/v1/chat/completions",
        body=orjson.dumps(body),
        headers={"Content-Type": "application/json", "X-Session-Id": session},
        timeout=300,
    )
    assert resp.status == 200, resp.data
    answer = orjson.loads(resp.data)
    return answer["choices"][0]["message"]["content"], dict(resp.headers), answer["usage"]


def recompute(server: ReplicaProcess, messages: list[dict[str, str]], template: str | None = None) -> str:
    """The same prompt (rendered by the server's chat template) on the same vLLM with the store not
    consulted: every token computed."""
    health = orjson.loads(urllib3.request("GET", server.url + "/healthz", timeout=10).data)
    folder = next(p for p in (REPO / "var" / "models").iterdir() if p.name.startswith(MODEL) and p.is_dir())
    ids = render_prompt(AutoTokenizer.from_pretrained(folder), messages, PromptFormat(template=template))
    body = {
        "model": MODEL,
        "prompt": ids,
        "temperature": 0,
        "max_tokens": 24,
        "kv_transfer_params": {"attnstore": {"tenant": "recompute", "reuse": False}},
    }
    resp = urllib3.request(
        "POST",
        health["local"][MODEL]["url"] + "/v1/completions",
        body=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
        timeout=300,
    )
    assert resp.status == 200, resp.data
    return str(orjson.loads(resp.data)["choices"][0]["text"])


Turn = tuple[list[dict[str, str]], str, dict[str, str], dict[str, Any]]


def converse(
    url: str,
    session: str,
    turns: int,
    history: list[dict[str, str]] | None = None,
    questions: list[str] = QUESTIONS,
) -> list[Turn]:
    """`turns` turns of one conversation (after `history`); each: (messages sent, answer, headers, usage)."""
    messages = list(history or [])
    done = []
    for question in questions[len([m for m in messages if m["role"] == "user"]) :][:turns]:
        messages.append({"role": "user", "content": question})
        answer, headers, usage = chat(url, messages, session)
        done.append((list(messages), answer, headers, usage))
        messages.append({"role": "assistant", "content": answer})
    return done


def saves_done(url: str) -> bool:
    return (
        orjson.loads(urllib3.request("GET", url + "/v1/attention_store/stats", timeout=30).data)[
            "saves_pending"
        ]
        == 0
    )


def assert_hit(headers: dict[str, str], usage: dict[str, Any], cache: str | None = None) -> int:
    reused = int(headers["X-AttentionStore-Reused-Tokens"])
    assert headers["X-AttentionStore-Cache"] != "miss" and reused > 0
    assert cache is None or headers["X-AttentionStore-Cache"] == cache
    assert usage["prompt_tokens_details"]["cached_tokens"] == reused
    return reused


def check_later_turns_hit_and_delete_forgets(server: ReplicaProcess, template: str | None = None) -> None:
    """Three turns: the first a miss served locally, each later one an l1_hit answering as vLLM
    recomputes it; DELETE forgets the conversation (its next turn a miss with the same answer)."""
    turns = converse(server.url, "conv-1", 3)
    first_headers = turns[0][2]
    assert (
        first_headers["X-AttentionStore-Cache"] == "miss"
        and first_headers["X-AttentionStore-Route"] == "local"
    )
    for messages, answer, headers, usage in turns[1:]:
        assert_hit(headers, usage, "l1_hit")
        assert answer == recompute(server, messages, template)
    gone = orjson.loads(
        urllib3.request("DELETE", server.url + "/v1/attention_store/sessions/conv-1", timeout=30).data
    )
    assert gone["deleted"] is True and gone["chunks"] > 0
    messages, answer, headers, _ = converse(
        server.url, "conv-1", 1, turns[1][0] + [{"role": "assistant", "content": turns[1][1]}]
    )[0]
    assert headers["X-AttentionStore-Cache"] == "miss" and answer == turns[2][1]


def test_later_turns_are_hits_whose_answers_equal_a_recompute_in_the_other_dtype(
    servers, vllm_python, tmp_path
):
    """The dtype `auto` does not pick on this CPU (float32 where it picks bfloat16, and the reverse): the
    CPU kernel lays KV out differently in each, and the default dtype is the next test's."""
    dtype = "float32" if DEFAULT_DTYPE == "bfloat16" else "bfloat16"
    (server,) = servers.start(settings(vllm_python, tmp_path / "kv", dtype=dtype))
    assert _served_dtype(server) == dtype
    check_later_turns_hit_and_delete_forgets(server)


def _served_dtype(server: ReplicaProcess) -> str:
    health = orjson.loads(urllib3.request("GET", server.url + "/healthz", timeout=10).data)
    return str(health["local"][MODEL]["dtype"])


def test_at_the_default_dtype_hits_survive_a_restart_a_corrupt_file_is_a_miss_and_agents_run(
    servers, vllm_python, tmp_path
):
    """At the default settings (dtype auto: the layout the CPU kernel uses by default), with the tools
    template of tests/support/tools.py: later turns hit and equal a recompute, DELETE forgets; a restart of
    attnstore and vLLM keeps the hits (from L2) and a corrupt L2 file is a miss; then issue 27's agent
    checks (written once above the engines) on the restarted server: a named and a required tool call
    (vLLM decodes under the serving layer's grammar), a Responses function call and its output, JSON
    Schema answers that validate, top_logprobs, n answers, an agent loop that reuses its history each
    turn. One test, so vLLM starts twice, not four times (a start takes about half a minute here)."""
    l2 = tmp_path / "kv"
    config = settings(vllm_python, l2)
    config["local_runner"]["chat_templates"] = {MODEL: str(shared_tools.TOOLS_TEMPLATE)}
    config["attention_store"]["position_encoding"]["max_context_tokens"] = 4096  # the agent loop's results
    template = shared_tools.TOOLS_TEMPLATE.read_text()
    (first,) = servers.start(config)
    assert _served_dtype(first) == DEFAULT_DTYPE
    check_later_turns_hit_and_delete_forgets(first, template)
    kept = converse(first.url, "kept", 2)
    wait_until(lambda: saves_done(first.url), "the first conversation on disk", timeout=60)
    before = {p for p in l2.rglob("*.safetensors")}
    broken = converse(first.url, "broken", 1, questions=OTHER_QUESTIONS)
    wait_until(lambda: saves_done(first.url), "the second conversation on disk", timeout=60)
    servers.stop()
    for path in {p for p in l2.rglob("*.safetensors")} - before:  # every chunk of the second conversation
        data = bytearray(path.read_bytes())
        data[-10] ^= 0x01
        path.write_bytes(bytes(data))
    (again,) = servers.start(config)
    history = [
        m
        for messages, answer, _, _ in kept[-1:]
        for m in [*messages, {"role": "assistant", "content": answer}]
    ]
    messages, answer, headers, usage = converse(again.url, "kept", 1, history)[0]
    assert_hit(headers, usage, "l2_hit")
    assert answer == recompute(again, messages, template)
    history = [*broken[0][0], {"role": "assistant", "content": broken[0][1]}]
    messages, answer, headers, _ = converse(again.url, "broken", 1, history, OTHER_QUESTIONS)[0]
    # Its own chunks are all bad: at most the system prompt it shares with the other conversation is
    # reused, never the history its files held.
    assert int(headers["X-AttentionStore-Reused-Tokens"]) < broken[0][3]["prompt_tokens"]
    assert answer == recompute(again, messages, template)
    stats = orjson.loads(urllib3.request("GET", again.url + "/v1/attention_store/stats", timeout=30).data)
    assert stats["quarantined"] >= 1

    c = openai.OpenAI(base_url=again.url + "/v1", api_key="agent", max_retries=0, timeout=300)
    agents.check_named_tool_choice(c, stream=False)
    agents.check_named_tool_choice(c, stream=True)
    agents.check_required(c)
    responses_tools.check_forced_call_and_its_output(c, stream=True)
    agents.check_json_schema(c, stream=True, subjects=agents.SUBJECTS[4:])
    agents.check_top_logprobs(c)
    agents.check_n_answers(c, again.url, stream=True, forks=False)
    agents.check_agent_loop(c, turns=8, chunk=128)
    agents.check_call_or_format(c, expect_call=False)
    agents.check_strict_tools(c)
    agents.check_ignore_eos_under_a_grammar(c, stream=True)


@pytest.mark.redis
def test_two_replicas_share_l2_through_redis(servers, vllm_python, tmp_path, redis_server):
    l2 = tmp_path / "shared-kv"
    a, b = servers.start(*(settings(vllm_python, l2, index=redis_server.url, name=n) for n in ("a", "b")))
    (first,) = converse(a.url, "shared", 1)
    wait_until(lambda: saves_done(a.url), "replica a's chunks on the shared disk", timeout=60)
    messages = [
        *first[0],
        {"role": "assistant", "content": first[1]},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    answer, headers, usage = chat(b.url, messages, "shared")
    assert_hit(headers, usage, "l2_hit")
    assert headers["X-AttentionStore-Replica"] == "b"
    assert answer == recompute(b, messages)


def test_anthropic_messages_on_vllm_read_the_first_turn_from_the_store(servers, vllm_python, tmp_path):
    """Anthropic's Messages API is the serving layer's, so vLLM serves it too: a second turn reads the
    first one's KV from the store (cache_read_input_tokens, the reused-tokens header), streamed or not;
    count_tokens is the turn's prompt; a forced tool call comes back as a tool_use block."""
    config = settings(vllm_python, tmp_path / "kv")
    config["local_runner"]["chat_templates"] = {MODEL: str(shared_tools.TOOLS_TEMPLATE)}
    (server,) = servers.start(config)
    c = anthropic.Anthropic(base_url=server.url, api_key="agent", max_retries=0, timeout=300)
    greedy = {"temperature": 0}
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTIONS[0]}]
    raw = c.messages.with_raw_response.create(
        model=MODEL, max_tokens=24, messages=messages, extra_body=greedy
    )
    first = raw.parse()
    assert raw.headers["X-AttentionStore-Route"] == "local" and first.usage.cache_read_input_tokens == 0
    assert first.content[0].type == "text" and first.stop_reason in ("end_turn", "max_tokens")
    messages += [
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    with c.messages.stream(model=MODEL, max_tokens=24, messages=messages, extra_body=greedy) as stream:
        text = "".join(stream.text_stream)
        second = stream.get_final_message()
        headers = stream.response.headers
    reused = int(headers["X-AttentionStore-Reused-Tokens"])
    assert headers["X-AttentionStore-Cache"] != "miss" and second.usage.cache_read_input_tokens == reused > 0
    total = (
        second.usage.input_tokens
        + second.usage.cache_read_input_tokens
        + second.usage.cache_creation_input_tokens
    )
    assert (
        text == second.content[0].text
        and c.messages.count_tokens(model=MODEL, messages=messages).input_tokens == total
    )
    search = {"name": "search_files", "input_schema": shared_tools.SEARCH["function"]["parameters"]}
    called = c.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=messages[:1],
        tools=[search],
        tool_choice={"type": "tool", "name": "search_files"},
        extra_body=greedy,
    )
    assert called.stop_reason == "tool_use" and called.content[-1].type == "tool_use"
    assert isinstance(called.content[-1].input["query"], str)
