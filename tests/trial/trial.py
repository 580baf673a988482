#!/usr/bin/env python3
"""A user's trial of attnstore with the official clients (openai, anthropic) against a running proxy.

    .venv/bin/python tests/trial/trial.py --base http://127.0.0.1:PORT --upstream http://127.0.0.1:FAKE_PORT \
        --label auto --log var/trial/server-auto.log

Normally started by run.sh (`make trial`), which starts the fake upstream and the proxy first. Prints
one line per check, PASS / FAIL / SKIP, then a summary; exits 1 when any check failed or was skipped.

Expects the settings run.sh writes: local models `smollm2-135m-instruct` (its own chat template) and `smollm2-tools` (the same weights, tests/templates/chatml_tools.jinja as its template, so
it serves tools), and an upstream (the fake of fake_upstream.py) serving `gpt-fake`.

Sections (--only 2,5 / --skip 9): 1 readiness, 2 chat reuse, 3 exactness, 4 completions + responses,
5 anthropic, 6 tools, 7 JSON, 8 concurrency, 9 agent loop, 10 pass-through, 11 errors, 12 store endpoints
and log. A section that needs another's results runs it too (3 needs 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anthropic
import jsonschema
import openai

from tests.support.tools import PERSON, RESPONSES_TOOLS, SEARCH, TOOLS, WEATHER

LOCAL = "smollm2-135m-instruct"
TOOLS_MODEL = "smollm2-tools"
T = TypeVar("T")
UPSTREAM_MODEL = "gpt-fake"
FAKE_TEXT = "Hello from the fake upstream."  # what the fake upstream answers every chat
HITS = ("l0_hit", "l1_hit", "l2_hit")
CACHE_VALUES = (*HITS, "miss", "bypass")
# Every local turn's headers (CONTRACT.md's eight, plus Skipped-Tokens of docs/api.md's table).
LOCAL_HEADERS = [
    "x-attentionstore-cache",
    "x-attentionstore-route",
    "x-attentionstore-reused-tokens",
    "x-attentionstore-session",
    "x-attentionstore-ttft-ms",
    "x-attentionstore-replica",
    "x-attentionstore-tiers",
    "x-attentionstore-position-shift",
    "x-attentionstore-skipped-tokens",
]
LOG_LINE = re.compile(
    r"\[AttentionStore\] session=(\S+) turn=(\d+) (l0_hit|l1_hit|l2_hit|miss|bypass) reused=(\d+) "
    r"prompt=(\d+) ttft_ms=([\d.]+)"
)

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SEARCH_ANTHROPIC = {
    "name": "search_files",
    "description": "Search the repository for a text.",
    "input_schema": SEARCH["function"]["parameters"],
}
TOPICS = [
    "the sea", "the moon", "volcanoes", "bees", "rivers", "deserts",
    "owls", "glaciers", "copper", "tea", "bridges", "clouds",
]  # fmt: skip


class Skip(Exception):
    pass


class Failed(AssertionError):
    pass


def ok(cond: Any, msg: str) -> None:
    """assert that survives python -O."""
    if not cond:
        raise Failed(msg)


def hdrs(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def short(text: Any, n: int = 80) -> str:
    s = repr(text)
    return s if len(s) <= n else s[: n - 3] + "..."


class Trial:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = args.base.rstrip("/")
        self.upstream = args.upstream.rstrip("/") if args.upstream else ""
        self.run = uuid.uuid4().hex[:8]  # keys and sessions unique to this run
        self.key = f"sk-trial-{self.run}-main"
        self.keys_used: set[str] = {self.key}
        self.results: list[tuple[str, str, str, str]] = []
        self.data: dict[str, Any] = {}
        self.oa = self.client_for(self.key)
        self.ac = anthropic.Anthropic(
            base_url=self.base, api_key=self.key, max_retries=0, timeout=args.timeout
        )

    # -- helpers ---------------------------------------------------------------------------------------

    def client_for(self, key: str) -> openai.OpenAI:
        self.keys_used.add(key)
        return openai.OpenAI(
            base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=self.args.timeout
        )

    def at_once(self, conversation: Callable[[openai.AsyncOpenAI, int], Awaitable[T]], n: int) -> list[T]:
        """`n` conversations at once through one async client (no retries): their results, in order."""

        async def main() -> list[T]:
            c = openai.AsyncOpenAI(
                base_url=self.base + "/v1", api_key=self.key, max_retries=0, timeout=self.args.timeout
            )
            try:
                return await asyncio.gather(*(conversation(c, i) for i in range(n)))
            finally:
                await c.close()

        return asyncio.run(main())

    def sid(self, name: str) -> str:
        return f"trial-{self.run}-{name}"

    def http(
        self,
        method: str,
        url: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> tuple[int, dict[str, str], bytes]:
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        h = {"Content-Type": "application/json"} if data is not None else {}
        h.update(headers or {})
        req = urllib.request.Request(url, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, hdrs(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            return err.code, hdrs(err.headers), err.read()

    def upstream_requests(self) -> list[dict]:
        if not self.upstream:
            raise Skip("no --upstream given")
        status, _, body = self.http("GET", self.upstream + "/_trial/requests")
        ok(status == 200, f"fake upstream's /_trial/requests answered {status}")
        return json.loads(body)

    def need(self, key: str) -> Any:
        if key not in self.data:
            raise Skip(f"needs {key!r} from an earlier check that failed or did not run")
        return self.data[key]

    def checks(self, section: int, named: list[tuple[str, Callable[[], str | None]]]) -> None:
        """A section's checks in order (each one as `check`)."""
        for name, fn in named:
            self.check(section, name, fn)

    def check(self, section: int, name: str, fn: Callable[[], str | None]) -> None:
        t0 = time.perf_counter()
        try:
            detail = fn() or ""
            status = "PASS"
        except Skip as exc:
            status, detail = "SKIP", str(exc)
        except openai.APIStatusError as exc:
            status, detail = "FAIL", f"{type(exc).__name__} {exc.status_code}: {short(exc.body, 300)}"
        except anthropic.APIStatusError as exc:
            status, detail = "FAIL", f"{type(exc).__name__} {exc.status_code}: {short(exc.body, 300)}"
        except AssertionError as exc:
            status, detail = "FAIL", str(exc) or traceback.format_exc(limit=2).strip().splitlines()[-1]
        except Exception as exc:  # noqa: BLE001 - a trial reports everything
            status = "FAIL"
            mine = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == __file__]
            where = f" (trial.py line {mine[-1].lineno})" if mine else ""
            detail = f"{type(exc).__name__}: {short(str(exc), 300)}{where}"
        dt = time.perf_counter() - t0
        label = f"{section}.{len([r for r in self.results if r[0] == str(section)]) + 1}"
        self.results.append((str(section), name, status, detail))
        print(f"{status} [{label}] {name} ({dt:.1f}s){': ' + detail if detail else ''}", flush=True)

    def local_headers(self, h: dict[str, str], session: str | None = None) -> tuple[str, int]:
        """Checks a local turn's X-AttentionStore-* headers; returns (cache, reused)."""
        missing = [n for n in LOCAL_HEADERS if n not in h]
        ok(not missing, f"missing headers: {missing} (got {sorted(k for k in h if k.startswith('x-att'))})")
        ok(h["x-attentionstore-route"] == "local", f"route {h['x-attentionstore-route']!r}, wanted local")
        cache = h["x-attentionstore-cache"]
        ok(cache in CACHE_VALUES, f"cache {cache!r} is not one of {CACHE_VALUES}")
        reused = int(h["x-attentionstore-reused-tokens"])
        float(h["x-attentionstore-ttft-ms"])
        int(h["x-attentionstore-position-shift"])
        int(h["x-attentionstore-skipped-tokens"])
        tiers = re.fullmatch(r"l0=(\d+),l1=(\d+),l2=(\d+)", h["x-attentionstore-tiers"])
        ok(tiers, f"Tiers header {h['x-attentionstore-tiers']!r} is not l0=<n>,l1=<n>,l2=<n>")
        ok(
            sum(map(int, tiers.groups())) == reused,
            f"Tiers {h['x-attentionstore-tiers']} do not add up to Reused-Tokens {reused}",
        )
        ok((cache == "miss") == (reused == 0), f"cache {cache} with reused {reused}")
        if session is not None:
            got = h["x-attentionstore-session"]
            ok(got == session, f"session header {got!r}, sent {session!r}")
        return cache, reused

    def chat(
        self,
        messages: list[dict],
        *,
        session: str | None,
        stream: bool = False,
        client: openai.OpenAI | None = None,
        model: str = LOCAL,
        max_tokens: int = 16,
        **kw: Any,
    ) -> dict[str, Any]:
        """One chat turn: {"content", "finish", "usage", "headers", "tool_calls"}."""
        c = client or self.oa
        kwargs: dict[str, Any] = dict(model=model, messages=messages, max_tokens=max_tokens, **kw)
        kwargs.setdefault("temperature", 0)
        if session is not None:
            kwargs["extra_body"] = {**kwargs.get("extra_body", {}), "session_id": session}
        if not stream:
            raw = c.chat.completions.with_raw_response.create(**kwargs)
            done = raw.parse()
            choice = done.choices[0]
            calls = [
                {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                for t in choice.message.tool_calls or []
            ]
            return {
                "content": choice.message.content or "",
                "finish": choice.finish_reason,
                "usage": done.usage,
                "headers": hdrs(raw.headers),
                "tool_calls": calls,
                "message": choice.message,
            }
        raw = c.chat.completions.with_raw_response.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        parts, calls, reason, usage = [], {}, None, None
        for chunk in raw.parse():
            usage = chunk.usage or usage
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                for call in ch.delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    entry["id"] += call.id or ""
                    entry["name"] += (call.function.name or "") if call.function else ""
                    entry["arguments"] += (call.function.arguments or "") if call.function else ""
                reason = ch.finish_reason or reason
        return {
            "content": "".join(parts),
            "finish": reason,
            "usage": usage,
            "headers": hdrs(raw.headers),
            "tool_calls": [calls[i] for i in sorted(calls)],
            "message": None,
        }

    def cached_equals_reused(self, usage: Any, reused: int, what: str = "usage") -> int:
        ok(usage is not None, f"no {what} (stream_options.include_usage was set)")
        details = usage.prompt_tokens_details
        ok(details is not None, f"{what}.prompt_tokens_details missing")
        ok(
            details.cached_tokens == reused,
            f"{what}.prompt_tokens_details.cached_tokens={details.cached_tokens} != Reused-Tokens {reused}",
        )
        return details.cached_tokens

    # -- 1. readiness ----------------------------------------------------------------------------------

    def s1(self) -> None:
        def while_starting() -> str:
            """A user's first try: one client, 8 conversations at once, sent as soon as the server
            answers (run.sh waits for an HTTP answer, not for 200), no retries."""
            status, _, body = self.http("GET", self.base + "/healthz", timeout=5)
            state = json.loads(body).get("status") if body else None

            async def conversation(c: openai.AsyncOpenAI, i: int) -> list[int]:
                msgs = [{"role": "user", "content": f"Name one fact about {TOPICS[i % len(TOPICS)]}."}]
                cached = []
                for _ in range(2):
                    done = await c.chat.completions.create(
                        model=LOCAL,
                        messages=msgs,
                        max_tokens=8,
                        extra_body={"session_id": self.sid(f"start-{i}")},
                    )
                    cached.append(done.usage.prompt_tokens_details.cached_tokens)
                    msgs += [{"role": "assistant", "content": done.choices[0].message.content or ""},
                             {"role": "user", "content": "One more?"}]  # fmt: skip
                return cached

            t0 = time.perf_counter()
            cached = self.at_once(conversation, 8)
            ok(all(second > 0 for _, second in cached), f"second turns not reused: {cached}")
            return f"/healthz said {status} {state!r} when sent; 16 turns answered in {time.perf_counter() - t0:.1f}s"

        def ready() -> str:
            deadline = time.monotonic() + self.args.ready_timeout
            last = None
            while time.monotonic() < deadline:
                try:
                    status, _, body = self.http("GET", self.base + "/healthz", timeout=5)
                    if status == 200:
                        doc = json.loads(body)
                        self.data["healthz"] = doc
                        ok(doc.get("status") == "ok", f"healthz status {doc.get('status')!r}")
                        local = (doc.get("local") or {}).get(LOCAL) or {}
                        ok(
                            set(doc.get("local_models") or []) >= {LOCAL, TOOLS_MODEL},
                            f"healthz local_models {doc.get('local_models')}",
                        )
                        return (
                            f"device={local.get('device')} dtype={local.get('dtype')} "
                            f"batch_invariant={local.get('batch_invariant')} warm_up={local.get('warm_up')!r} "
                            f"upstream={doc.get('upstream')!r}"
                        )
                    last = f"status {status}"
                except OSError as exc:
                    last = repr(exc)
                time.sleep(1)
            raise Failed(f"/healthz not 200 within {self.args.ready_timeout}s (last: {last})")

        def first_request() -> str:
            t0 = time.perf_counter()
            turn = self.chat([{"role": "user", "content": "Say hi."}], session=None, max_tokens=8)
            self.local_headers(turn["headers"])
            ok(turn["finish"] in ("stop", "length"), f"finish_reason {turn['finish']!r}")
            ok(turn["usage"].completion_tokens > 0, "no completion tokens")
            return f"{time.perf_counter() - t0:.2f}s, answer {short(turn['content'])}"

        self.checks(
            1,
            [
                ("8 conversations sent as soon as the server answers are all served", while_starting),
                ("GET /healthz answers 200 with status ok", ready),
                ("first chat request right after start succeeds (local)", first_request),
            ],
        )

    # -- 2. chat completions reuse -----------------------------------------------------------------------

    Q1 = "What does a KV cache store in a transformer? Answer briefly."
    Q2 = "Why does it make multi-turn chats cheaper?"
    SYSTEM = "You are a concise assistant."

    def conversation(self, stream: bool) -> None:
        tag = "stream" if stream else "json"
        sid = self.sid(f"chat-{tag}")
        first_msgs = [{"role": "system", "content": self.SYSTEM}, {"role": "user", "content": self.Q1}]

        def turn1() -> str:
            t = self.chat(first_msgs, session=sid, stream=stream)
            cache, reused = self.local_headers(t["headers"], sid)
            self.cached_equals_reused(t["usage"], reused)
            ok(t["finish"] in ("stop", "length"), f"finish_reason {t['finish']!r}")
            ok(t["content"], "empty answer")
            self.data[f"chat-{tag}-1"] = t
            return f"{cache} reused={reused} prompt={t['usage'].prompt_tokens} answer {short(t['content'])}"

        def turn2() -> str:
            first = self.need(f"chat-{tag}-1")
            msgs = [
                *first_msgs,
                {"role": "assistant", "content": first["content"]},
                {"role": "user", "content": self.Q2},
            ]
            t = self.chat(msgs, session=sid, stream=stream)
            cache, reused = self.local_headers(t["headers"], sid)
            ok(cache in HITS, f"turn 2 cache {cache!r}, wanted a hit")
            ok(reused > 0, "turn 2 reused 0 tokens")
            self.cached_equals_reused(t["usage"], reused)
            t["messages"] = msgs
            self.data[f"chat-{tag}-2"] = t
            return (
                f"{cache} reused={reused}/{t['usage'].prompt_tokens} ttft_ms={t['headers']['x-attentionstore-ttft-ms']} "
                f"(turn 1: {first['headers']['x-attentionstore-ttft-ms']})"
            )

        kind = "streamed (include_usage)" if stream else "non-streamed"
        self.checks(
            2,
            [
                (f"chat {kind} turn 1: local, X-AttentionStore-* headers, cached_tokens == reused", turn1),
                (
                    f"chat {kind} turn 2 of the same conversation: hit, reused > 0, cached_tokens == reused",
                    turn2,
                ),
            ],
        )

    def s2(self) -> None:
        self.conversation(stream=False)
        self.conversation(stream=True)

    # -- 3. exactness -------------------------------------------------------------------------------------

    def s3(self) -> None:
        def recompute() -> str:
            hit = self.need("chat-json-2")
            # Reuse matches token ids within a tenant whatever the session id (docs/api.md, "Sessions"), so
            # a fresh session id alone would still reuse turn 2's prefix: a fresh tenant (another key)
            # shares no KV, so its turn is a true recompute.
            fresh = self.client_for(f"sk-trial-{self.run}-recompute")
            t = self.chat(hit["messages"], session=self.sid("recompute"), client=fresh)
            cache, reused = self.local_headers(t["headers"], self.sid("recompute"))
            ok(cache == "miss" and reused == 0, f"the recompute was not a miss: {cache} reused={reused}")
            ok(
                t["usage"].prompt_tokens == hit["usage"].prompt_tokens,
                f"prompt tokens differ: recompute {t['usage'].prompt_tokens}, hit {hit['usage'].prompt_tokens}",
            )
            ok(
                t["content"] == hit["content"],
                f"reused turn answered {hit['content']!r}, recompute answered {t['content']!r}",
            )
            return (
                f"equal ({len(t['content'])} chars), hit reused "
                f"{hit['headers']['x-attentionstore-reused-tokens']} tokens, recompute a miss"
            )

        def fresh_session_same_tenant() -> str:
            hit = self.need("chat-json-2")
            t = self.chat(hit["messages"], session=self.sid("fresh-session"))
            cache, reused = self.local_headers(t["headers"], self.sid("fresh-session"))
            ok(t["content"] == hit["content"], f"{hit['content']!r} != {t['content']!r}")
            return f"equal; this turn was {cache} reused={reused} (reuse matches tokens, not sessions)"

        def stream_equals_json() -> str:
            for n in (1, 2):
                a, b = self.need(f"chat-json-{n}"), self.need(f"chat-stream-{n}")
                ok(
                    a["content"] == b["content"],
                    f"turn {n}: non-stream {a['content']!r} != stream {b['content']!r}",
                )
            return "turns 1 and 2 equal"

        self.checks(
            3,
            [
                (
                    "temperature 0: turn 2 served from reused KV == full recompute (fresh tenant, miss)",
                    recompute,
                ),
                (
                    "temperature 0: same prompt under a fresh session id (same tenant) answers the same",
                    fresh_session_same_tenant,
                ),
                ("temperature 0: streamed answers == non-streamed answers", stream_equals_json),
            ],
        )

    # -- 4. completions and responses -----------------------------------------------------------------------

    PROMPT = "The capital of France is Paris. The capital of Italy is"

    def s4(self) -> None:
        c = self.oa

        def completion() -> str:
            prompt = self.PROMPT + f" (run {self.run})"  # unique per run
            raw = c.completions.with_raw_response.create(
                model=LOCAL, prompt=prompt, max_tokens=8, temperature=0
            )
            done = raw.parse()
            ok(done.object == "text_completion", f"object {done.object!r}")
            cache, reused = self.local_headers(hdrs(raw.headers))
            self.cached_equals_reused(done.usage, reused)
            self.data["completion-1"] = (prompt, done.choices[0].text)
            return f"{cache} text {short(done.choices[0].text)}"

        def completion_extended() -> str:
            prompt, text = self.need("completion-1")
            longer = prompt + text + " The capital of Spain is"
            raw = c.completions.with_raw_response.create(
                model=LOCAL, prompt=longer, max_tokens=8, temperature=0
            )
            done = raw.parse()
            cache, reused = self.local_headers(hdrs(raw.headers))
            ok(cache in HITS and reused > 0, f"extension not a hit: {cache} reused={reused}")
            self.cached_equals_reused(done.usage, reused)
            self.data["completion-2"] = (longer, done.choices[0].text)
            return f"{cache} reused={reused}/{done.usage.prompt_tokens}"

        def completion_stream() -> str:
            longer, text = self.need("completion-2")
            raw = c.completions.with_raw_response.create(
                model=LOCAL, prompt=longer, max_tokens=8, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            parts, usage = [], None
            for chunk in raw.parse():
                usage = chunk.usage or usage
                parts.extend(ch.text for ch in chunk.choices)
            cache, reused = self.local_headers(hdrs(raw.headers))
            self.cached_equals_reused(usage, reused)
            ok("".join(parts) == text, f"streamed {''.join(parts)!r} != non-streamed {text!r}")
            return f"{cache} reused={reused}, same text as non-streamed"

        rq = f"Name two uses of a cache. (run {self.run})"

        def response_first() -> str:
            raw = c.responses.with_raw_response.create(
                model=LOCAL, input=rq, instructions="Be brief.", max_output_tokens=16, temperature=0
            )
            first = raw.parse()
            h = hdrs(raw.headers)
            ok(first.id.startswith("resp_"), f"id {first.id!r}")
            cache, reused = self.local_headers(h, first.id)
            ok(first.status in ("completed", "incomplete"), f"status {first.status!r}")
            ok(first.output_text, "empty output_text")
            ok(
                first.usage.input_tokens_details.cached_tokens == reused,
                "input cached_tokens != Reused-Tokens",
            )
            self.data["response-1"] = first
            return f"{first.id} {first.status} {cache} text {short(first.output_text)}"

        def response_follow_up() -> str:
            first = self.need("response-1")
            raw = c.responses.with_raw_response.create(
                model=LOCAL,
                input="Say more.",
                previous_response_id=first.id,
                max_output_tokens=16,
                temperature=0,
            )
            second = raw.parse()
            cache, reused = self.local_headers(hdrs(raw.headers), second.id)
            ok(
                second.previous_response_id == first.id,
                f"previous_response_id {second.previous_response_id!r}",
            )
            cached = second.usage.input_tokens_details.cached_tokens
            ok(cache in HITS and reused > 0, f"follow-up not a hit: {cache} reused={reused}")
            ok(
                cached == reused,
                f"usage.input_tokens_details.cached_tokens {cached} != Reused-Tokens {reused}",
            )
            self.data["response-2"] = second
            return f"{cache} cached_tokens={cached}/{second.usage.input_tokens}"

        def response_get_delete() -> str:
            second = self.need("response-2")
            got = c.responses.retrieve(second.id)
            ok(got.id == second.id and got.output_text == second.output_text, "GET returned another response")
            c.responses.delete(second.id)
            try:
                c.responses.retrieve(second.id)
            except openai.NotFoundError:
                pass
            else:
                raise Failed("GET after DELETE did not 404")
            # The first response of the chain is still there.
            first = self.need("response-1")
            ok(c.responses.retrieve(first.id).id == first.id, "first response gone too")
            return "GET matched, DELETE then GET 404"

        def response_stream() -> str:
            with c.responses.stream(model=LOCAL, input=rq, max_output_tokens=8, temperature=0) as s:
                events = list(s)
                kinds = [e.type for e in events]
                final = events[-1].response  # get_final_response() wants response.completed only
            ok(kinds and kinds[0] == "response.created", f"first event {kinds[:1]}")
            ok(kinds[-1] in ("response.completed", "response.incomplete"), f"last event {kinds[-1:]}")
            ok("response.output_text.delta" in kinds, "no output_text.delta event")
            ok(final.output_text, "empty final output_text")
            return f"{len(kinds)} events, text {short(final.output_text)}"

        self.checks(
            4,
            [
                ("/v1/completions (string prompt): local, headers, cached_tokens == reused", completion),
                ("/v1/completions extending the last prompt + answer: hit", completion_extended),
                (
                    "/v1/completions streamed (include_usage): same text, cached_tokens == reused",
                    completion_stream,
                ),
                ("/v1/responses first turn (instructions): resp_ id, session header == id", response_first),
                (
                    "/v1/responses previous_response_id follow-up: hit, input cached_tokens == reused",
                    response_follow_up,
                ),
                ("GET /v1/responses/{id} then DELETE, then GET is 404", response_get_delete),
                ("/v1/responses streamed: documented event sequence", response_stream),
            ],
        )

    # -- 5. anthropic -----------------------------------------------------------------------------------

    def s5(self) -> None:
        ac = self.ac
        sid = self.sid("anthropic")
        system = "You are a helpful assistant. Keep answers short."
        msgs1 = [{"role": "user", "content": "Name three colors."}]
        kwargs = dict(
            model=LOCAL, max_tokens=16, system=system, messages=msgs1,
            extra_body={"temperature": 0}, extra_headers={"X-Session-Id": sid},
        )  # fmt: skip

        def create() -> str:
            raw = ac.messages.with_raw_response.create(**kwargs)
            msg = raw.parse()
            h = hdrs(raw.headers)
            cache, reused = self.local_headers(h, sid)
            ok(
                msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant",
                f"{msg.id} {msg.type}",
            )
            ok([b.type for b in msg.content] == ["text"] and msg.content[0].text, f"content {msg.content}")
            ok(msg.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {msg.stop_reason!r}")
            ok(
                msg.usage.cache_read_input_tokens == reused,
                f"cache_read {msg.usage.cache_read_input_tokens} != {reused}",
            )
            ok(msg.usage.output_tokens <= 16, f"output_tokens {msg.usage.output_tokens}")
            self.data["anthropic-1"] = msg
            return (
                f"{cache} usage={msg.usage.model_dump(exclude_none=True)} text {short(msg.content[0].text)}"
            )

        def stream() -> str:
            first = self.need("anthropic-1")
            with ac.messages.stream(**kwargs) as s:
                texts = list(s.text_stream)
                final = s.get_final_message()
                h = hdrs(s.response.headers)
            cache, reused = self.local_headers(h, sid)
            ok("".join(texts) == final.content[0].text == first.content[0].text,
               f"stream {''.join(texts)!r} vs create {first.content[0].text!r}")  # fmt: skip
            ok(
                final.usage.cache_read_input_tokens == reused,
                f"cache_read {final.usage.cache_read_input_tokens} != {reused}",
            )
            return f"{cache} cache_read={reused}, same text as create"

        def second_turn() -> str:
            first = self.need("anthropic-1")
            msgs = [*msgs1, {"role": "assistant", "content": first.content[0].text},
                    {"role": "user", "content": "Which of them is warmest?"}]  # fmt: skip
            raw = ac.messages.with_raw_response.create(**{**kwargs, "messages": msgs})
            msg = raw.parse()
            cache, reused = self.local_headers(hdrs(raw.headers), sid)
            u = msg.usage
            ok(
                cache in HITS and u.cache_read_input_tokens > 0,
                f"second turn {cache} cache_read={u.cache_read_input_tokens}",
            )
            ok(
                u.cache_read_input_tokens == reused,
                f"cache_read {u.cache_read_input_tokens} != Reused-Tokens {reused}",
            )
            self.data["anthropic-2"] = (msgs, u)
            return f"{cache} input={u.input_tokens} cache_read={u.cache_read_input_tokens} creation={u.cache_creation_input_tokens}"

        def count_tokens() -> str:
            msgs, u = self.need("anthropic-2")
            counted = ac.messages.count_tokens(model=LOCAL, system=system, messages=msgs)
            total = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
            ok(
                counted.input_tokens == total,
                f"count_tokens {counted.input_tokens} != the turn's prompt {total}",
            )
            return f"{counted.input_tokens} tokens"

        def error_shape() -> str:
            body = {"model": LOCAL, "messages": [{"role": "user", "content": "hi"}]}  # no max_tokens
            status, _, raw = self.http("POST", self.base + "/v1/messages", body, {"x-api-key": self.key})
            doc = json.loads(raw)
            ok(status == 400, f"status {status}")
            ok(doc.get("type") == "error" and doc["error"]["type"] == "invalid_request_error", f"body {doc}")
            return f"{doc['error']['message']!r}"

        self.checks(
            5,
            [
                ("anthropic messages.create, system prompt: local, headers, cache_read == reused", create),
                ("anthropic messages.stream: same text, cache_read == reused", stream),
                ("anthropic second turn: hit, cache_read_input_tokens > 0", second_turn),
                ("anthropic count_tokens == input + cache_read + cache_creation of that turn", count_tokens),
                ("anthropic bad request: 400 in Anthropic's error shape", error_shape),
            ],
        )

    # -- 6. tools --------------------------------------------------------------------------------------

    def s6(self) -> None:
        sid = self.sid("tools")
        msgs = [{"role": "user", "content": "What is the weather in Lisbon?"}]

        def required() -> str:
            t = self.chat(
                msgs, session=sid, model=TOOLS_MODEL, tools=TOOLS, tool_choice="required", max_tokens=60
            )
            self.local_headers(t["headers"], sid)
            ok(t["finish"] == "tool_calls", f"finish_reason {t['finish']!r}, content {t['content']!r}")
            ok(t["tool_calls"], "no tool_calls")
            call = t["tool_calls"][0]
            ok(call["name"] in SCHEMAS, f"unknown function {call['name']!r}")
            args = json.loads(call["arguments"])
            jsonschema.validate(args, SCHEMAS[call["name"]])
            self.data["tool-1"] = t
            return f"{call['name']}({call['arguments']}) id={call['id']}"

        def call_under_a_format() -> str:
            t = self.chat(
                [{"role": "user", "content": "What's the weather in Oslo?"}],
                session=self.sid("tools-format"),
                model=TOOLS_MODEL,
                tools=TOOLS,
                response_format={"type": "json_object"},
                parallel_tool_calls=False,
                stream=True,
                max_tokens=60,
            )
            self.local_headers(t["headers"], None)
            if t["tool_calls"]:
                ok(
                    len(t["tool_calls"]) == 1 and t["finish"] == "tool_calls",
                    f"{t['tool_calls']} {t['finish']}",
                )
                call = t["tool_calls"][0]
                jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
                return f"{call['name']}({call['arguments']})"
            ok(isinstance(json.loads(t["content"]), dict), f"content {t['content']!r}")
            return f"JSON {t['content'][:60]!r}"

        def tool_follow_up() -> str:
            first = self.need("tool-1")
            call = first["tool_calls"][0]
            history = [
                *msgs,
                {
                    "role": "assistant",
                    "content": first["content"] or None,
                    "tool_calls": [
                        {
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["name"], "arguments": call["arguments"]},
                        }
                    ],
                },  # fmt: skip
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": '{"temperature_c": 21, "sky": "clear"}',
                },
            ]
            t = self.chat(history, session=sid, model=TOOLS_MODEL, tools=TOOLS, max_tokens=24)
            cache, reused = self.local_headers(t["headers"], sid)
            ok(t["finish"] in ("stop", "length", "tool_calls"), f"finish_reason {t['finish']!r}")
            ok(cache in HITS and reused > 0, f"follow-up {cache} reused={reused}")
            self.cached_equals_reused(t["usage"], reused)
            return f"{cache} reused={reused}/{t['usage'].prompt_tokens} finish={t['finish']} {short(t['content'] or t['tool_calls'])}"

        def named_stream() -> str:
            choice = {"type": "function", "function": {"name": "get_weather"}}
            t = self.chat(
                [{"role": "user", "content": "Is it warm in Oslo today?"}], session=self.sid("tools-stream"),
                stream=True, model=TOOLS_MODEL, tools=TOOLS, tool_choice=choice, max_tokens=60,
            )  # fmt: skip
            self.local_headers(t["headers"])
            ok(
                t["finish"] == "tool_calls" and len(t["tool_calls"]) == 1,
                f"{t['finish']} {t['tool_calls']} {t['content']!r}",
            )
            call = t["tool_calls"][0]
            ok(call["name"] == "get_weather" and call["id"].startswith("call_"), f"call {call}")
            jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])
            return f"get_weather({call['arguments']})"

        def tools_on_a_template_without_tools() -> str:
            # SmolLM2's own template renders no tools: the turn goes upstream (the fake answers).
            t = self.chat(msgs, session=None, model=LOCAL, tools=TOOLS, max_tokens=16)
            ok(
                t["headers"].get("x-attentionstore-route") == "upstream",
                f"route {t['headers'].get('x-attentionstore-route')}",
            )
            ok(t["content"] == FAKE_TEXT, f"content {t['content']!r}")
            return "forwarded upstream"

        def anthropic_tools() -> str:
            raw = self.ac.messages.with_raw_response.create(
                model=TOOLS_MODEL, max_tokens=60, tools=[SEARCH_ANTHROPIC], tool_choice={"type": "any"},
                messages=[{"role": "user", "content": "Find where the parser is defined."}],
                extra_body={"temperature": 0}, extra_headers={"X-Session-Id": self.sid("anthropic-tools")},
            )  # fmt: skip
            msg = raw.parse()
            self.local_headers(hdrs(raw.headers))
            ok(msg.stop_reason == "tool_use", f"stop_reason {msg.stop_reason!r} content {msg.content}")
            uses = [b for b in msg.content if b.type == "tool_use"]
            ok(len(uses) >= 1 and uses[0].name == "search_files", f"blocks {msg.content}")
            ok(uses[0].id.startswith("toolu_") and isinstance(uses[0].input, dict), f"block {uses[0]}")
            jsonschema.validate(uses[0].input, SEARCH_ANTHROPIC["input_schema"])
            self.data["anthropic-tool"] = msg
            return f"tool_use {uses[0].name}({json.dumps(uses[0].input)})"

        def anthropic_tool_result() -> str:
            first = self.need("anthropic-tool")
            call = next(b for b in first.content if b.type == "tool_use")
            msgs2 = [
                {"role": "user", "content": "Find where the parser is defined."},
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": call.id, "content": "proxy/parser.py:12"}
                    ],
                },
            ]
            raw = self.ac.messages.with_raw_response.create(
                model=TOOLS_MODEL, max_tokens=24, tools=[SEARCH_ANTHROPIC], messages=msgs2,
                extra_body={"temperature": 0}, extra_headers={"X-Session-Id": self.sid("anthropic-tools")},
            )  # fmt: skip
            msg = raw.parse()
            cache, reused = self.local_headers(hdrs(raw.headers))
            ok(msg.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"stop_reason {msg.stop_reason!r}")
            ok(
                cache in HITS and msg.usage.cache_read_input_tokens > 0,
                f"{cache} cache_read={msg.usage.cache_read_input_tokens}",
            )
            return f"{cache} cache_read={msg.usage.cache_read_input_tokens} stop={msg.stop_reason}"

        def responses_tool_call() -> str:
            raw = self.oa.responses.with_raw_response.create(
                model=TOOLS_MODEL, input=f"What is the weather in Porto? (run {self.run})",
                tools=RESPONSES_TOOLS, tool_choice="required", max_output_tokens=60, temperature=0,
            )  # fmt: skip
            first = raw.parse()
            self.local_headers(hdrs(raw.headers), first.id)
            calls = [item for item in first.output if item.type == "function_call"]
            ok(first.status == "completed" and calls, f"status {first.status} output {first.output}")
            call = calls[0]
            ok(call.call_id.startswith("call_") and call.name in SCHEMAS, f"call {call}")
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            self.data["response-tool"] = first
            return f"{call.name}({call.arguments}) call_id={call.call_id}"

        def responses_tool_output() -> str:
            first = self.need("response-tool")
            call = next(item for item in first.output if item.type == "function_call")
            result = {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": '{"temperature_c": 19}',
            }
            chunks, final = [], None
            with self.oa.responses.create(
                model=TOOLS_MODEL, previous_response_id=first.id, input=[result], tools=RESPONSES_TOOLS,
                max_output_tokens=24, temperature=0, stream=True,
            ) as events:  # fmt: skip
                for event in events:
                    if event.type == "response.output_text.delta":
                        chunks.append(event.delta)
                    if event.type in ("response.completed", "response.incomplete"):
                        final = event.response
            ok(final is not None, "no response.completed / response.incomplete")
            assert final is not None
            cached = final.usage.input_tokens_details.cached_tokens
            ok(cached > 0, f"cached_tokens {cached} of {final.usage.input_tokens}")
            self.data["response-tool-2"] = (final, result)
            return f"{final.status} cached={cached}/{final.usage.input_tokens} {short(''.join(chunks) or final.output)}"

        def responses_items_and_count() -> str:
            first = self.need("response-tool")
            second, result = self.need("response-tool-2")
            kinds = [item.type for item in self.oa.responses.input_items.list(second.id, order="asc")]
            ok(kinds == ["message", "function_call", "function_call_output"], f"input items {kinds}")
            counted = self.oa.responses.input_tokens.count(
                model=TOOLS_MODEL, previous_response_id=first.id, input=[result], tools=RESPONSES_TOOLS
            )
            ok(counted.input_tokens == second.usage.input_tokens, f"{counted.input_tokens} != {second.usage}")
            return f"items {kinds}, input_tokens {counted.input_tokens} == the turn's"

        def unpaired_results() -> str:
            orphan = [
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "call_x", "content": "1"},
            ]
            try:
                self.oa.chat.completions.create(model=TOOLS_MODEL, messages=orphan, max_tokens=2)
            except openai.BadRequestError as exc:
                ok(exc.param == "messages.[1].role", f"param {exc.param!r}")
            else:
                raise Failed("a tool message without its call was served")
            try:
                self.ac.messages.create(
                    model=TOOLS_MODEL,
                    max_tokens=2,
                    messages=[
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}
                    ],
                )
            except anthropic.BadRequestError as exc:
                ok("unexpected `tool_use_id`" in str(exc), str(exc))
            else:
                raise Failed("a tool_result without its tool_use was served")
            return "openai 400 messages.[1].role, anthropic 400 unexpected tool_use_id"

        self.checks(
            6,
            [
                ("openai tools, tool_choice required (tools-template model): valid JSON arguments", required),
                ("openai role:tool follow-up: answers, hit with cached_tokens == reused", tool_follow_up),
                ("openai named tool_choice, streamed: one whole valid call", named_stream),
                (
                    "openai tools + json_object, auto, no parallel calls, streamed: one call or JSON",
                    call_under_a_format,
                ),
                (
                    "tools for a model whose template renders none go upstream",
                    tools_on_a_template_without_tools,
                ),
                (
                    "/v1/responses function tools, required: a function_call item, valid arguments",
                    responses_tool_call,
                ),
                (
                    "/v1/responses function_call_output follow-up, streamed: answers, cached_tokens > 0",
                    responses_tool_output,
                ),
                (
                    "/v1/responses input_items of the follow-up, and input_tokens == its input_tokens",
                    responses_items_and_count,
                ),
                ("a tool result without its call: each API's 400", unpaired_results),
                ("anthropic tools, tool_choice any: a tool_use block with a valid input", anthropic_tools),
                ("anthropic tool_result follow-up: answers, hit", anthropic_tool_result),
            ],
        )

    # -- 7. JSON mode ----------------------------------------------------------------------------------

    def s7(self) -> None:
        def json_object() -> str:
            t = self.chat(
                [{"role": "user", "content": "Reply with a JSON object: the key color, the value red."}],
                session=None, response_format={"type": "json_object"}, max_tokens=48,
            )  # fmt: skip
            self.local_headers(t["headers"])
            ok(
                t["finish"] == "stop",
                f"finish_reason {t['finish']!r} (max_tokens reached?) content {t['content']!r}",
            )
            doc = json.loads(t["content"])
            ok(isinstance(doc, dict), f"not an object: {doc!r}")
            return t["content"]

        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

        def json_schema(stream: bool) -> Callable[[], str]:
            def run() -> str:
                subject = "a baker" if stream else "a pilot"
                t = self.chat(
                    [{"role": "user", "content": f"Describe {subject} as JSON."}],
                    session=None, stream=stream, response_format=fmt, max_tokens=64,
                )  # fmt: skip
                self.local_headers(t["headers"])
                jsonschema.validate(json.loads(t["content"]), PERSON)
                return t["content"]

            return run

        def bad_schema() -> str:
            bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
            try:
                self.chat(
                    [{"role": "user", "content": "hi"}], session=None, response_format=bad, max_tokens=8
                )
            except openai.BadRequestError as exc:
                ok(exc.body.get("param") == "response_format", f"param {exc.body.get('param')!r}")
                return "400 naming response_format"
            raise Failed("an impossible schema was accepted")

        def responses_text_format() -> str:
            text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
            raw = self.oa.responses.with_raw_response.create(
                model=LOCAL,
                input="Describe a sailor as JSON.",
                text=text,
                max_output_tokens=64,
                temperature=0,
            )
            answer = raw.parse()
            self.local_headers(hdrs(raw.headers), answer.id)
            jsonschema.validate(json.loads(answer.output_text), PERSON)
            ok(answer.text.format.type == "json_schema", f"text {answer.text}")
            return answer.output_text

        self.checks(
            7,
            [
                ("response_format json_object: parseable JSON object", json_object),
                ("response_format json_schema strict: validates against the schema", json_schema(False)),
                ("response_format json_schema strict, streamed: validates", json_schema(True)),
                ("an uncompilable schema is a 400 naming response_format", bad_schema),
                ("/v1/responses text.format json_schema: validates, echoed", responses_text_format),
            ],
        )

    # -- 8. concurrency ---------------------------------------------------------------------------------

    def s8(self) -> None:
        def async_clients() -> str:
            async def conversation(c: openai.AsyncOpenAI, i: int) -> list[dict]:
                sid = self.sid(f"conc-{i}")
                msgs: list[dict] = [{"role": "user", "content": f"Tell me one fact about {TOPICS[i]}."}]
                out = []
                for turn, follow in enumerate(("Another one.", "And one more.", None)):
                    try:
                        raw = await c.chat.completions.with_raw_response.create(
                            model=LOCAL,
                            messages=msgs,
                            max_tokens=8,
                            temperature=0,
                            extra_body={"session_id": sid},
                        )
                        done = raw.parse()
                        h = hdrs(raw.headers)
                        cache, reused = self.local_headers(h, sid)
                        cached = done.usage.prompt_tokens_details.cached_tokens
                        out.append({"turn": turn, "cache": cache, "reused": reused, "cached": cached,
                                    "content": done.choices[0].message.content or "", "error": None})  # fmt: skip
                    except Exception as exc:  # noqa: BLE001
                        out.append({"turn": turn, "error": f"{type(exc).__name__}: {short(str(exc), 200)}"})
                        return out
                    if follow:
                        msgs += [
                            {"role": "assistant", "content": out[-1]["content"]},
                            {"role": "user", "content": follow},
                        ]
                return out

            t0 = time.perf_counter()
            convs = self.at_once(conversation, 12)
            wall = time.perf_counter() - t0
            self.data["conc"] = convs
            errors = [(i, r["turn"], r["error"]) for i, conv in enumerate(convs) for r in conv if r["error"]]
            ok(not errors, f"{len(errors)} failed turns, e.g. {errors[:3]}")
            ok(all(len(conv) == 3 for conv in convs), "a conversation did not finish 3 turns")
            misses = [
                (i, r["turn"], r["cache"])
                for i, conv in enumerate(convs)
                for r in conv[1:]
                if r["cache"] not in HITS
            ]
            ok(not misses, f"turns >= 2 that were not hits: {misses}")
            wrong = [
                (i, r["turn"]) for i, conv in enumerate(convs) for r in conv if r["cached"] != r["reused"]
            ]
            ok(not wrong, f"cached_tokens != Reused-Tokens at {wrong}")
            return f"36 turns in {wall:.1f}s; turns 2-3 all hits (reused min {min(r['reused'] for c in convs for r in c[1:])})"

        def batching_never_changes_an_answer() -> str:
            convs = self.need("conc")
            fresh = self.client_for(f"sk-trial-{self.run}-alone")
            for i in range(3):
                t = self.chat([{"role": "user", "content": f"Tell me one fact about {TOPICS[i]}."}],
                              session=self.sid(f"alone-{i}"), client=fresh, max_tokens=8)  # fmt: skip
                ok(t["content"] == convs[i][0]["content"],
                   f"conversation {i}: under load {convs[i][0]['content']!r}, alone {t['content']!r}")  # fmt: skip
            return "3 first turns answered alone (fresh tenant) == under load"

        def threaded_clients() -> str:
            results: list[tuple[int, int, int, str | None, str | None]] = []
            lock = threading.Lock()

            def worker(w: int) -> None:
                c = self.client_for(f"sk-trial-{self.run}-client{w}")
                for conv in range(2):
                    sid = self.sid(f"thread-{w}-{conv}")
                    msgs: list[dict] = [
                        {"role": "user", "content": f"Give a tip about {TOPICS[(w * 2 + conv) % 12]}."}
                    ]
                    for turn in range(2):
                        try:
                            t = self.chat(msgs, session=sid, client=c, max_tokens=8)
                            cache, _ = self.local_headers(t["headers"], sid)
                            err = None
                            msgs += [
                                {"role": "assistant", "content": t["content"]},
                                {"role": "user", "content": "Why?"},
                            ]
                        except Exception as exc:  # noqa: BLE001
                            cache, err = None, f"{type(exc).__name__}: {short(str(exc), 200)}"
                        with lock:
                            results.append((w, conv, turn, cache, err))
                        if err:
                            break

            t0 = time.perf_counter()
            threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            wall = time.perf_counter() - t0
            errors = [r for r in results if r[4]]
            ok(not errors, f"failed turns: {errors[:3]}")
            ok(len(results) == 12, f"{len(results)} turns done, wanted 12")
            misses = [r for r in results if r[2] == 1 and r[3] not in HITS]
            ok(not misses, f"second turns not hits: {misses}")
            return f"3 clients x 2 conversations x 2 turns in {wall:.1f}s, second turns all hits"

        self.checks(
            8,
            [
                (
                    "one AsyncOpenAI client, 12 conversations x 3 turns at once: all succeed, turns >= 2 hits",
                    async_clients,
                ),
                (
                    "answers under load == the same prompts alone (temperature 0)",
                    batching_never_changes_an_answer,
                ),
                (
                    "3 separate clients (threads, own keys) at once: all succeed, second turns hits",
                    threaded_clients,
                ),
            ],
        )

    # -- 9. a long agent loop -----------------------------------------------------------------------------

    def s9(self) -> None:
        turns = self.args.agent_turns

        def loop() -> str:
            sid = self.sid("agent")
            msgs: list[dict] = [
                {"role": "system", "content": "You are a coding agent. Use the tools."},
                {"role": "user", "content": "Find every handler in the repository."},
            ]
            rows, t0 = [], time.perf_counter()
            for turn in range(turns):
                try:
                    t = self.chat(
                        msgs, session=sid, model=TOOLS_MODEL, tools=[SEARCH], max_tokens=60,
                        tool_choice={"type": "function", "function": {"name": "search_files"}},
                    )  # fmt: skip
                    cache, reused = self.local_headers(t["headers"], sid)
                    ok(
                        t["finish"] == "tool_calls" and t["tool_calls"],
                        f"finish {t['finish']!r} content {t['content']!r}",
                    )
                    call = t["tool_calls"][0]
                    json.loads(call["arguments"])
                except Exception as exc:  # noqa: BLE001
                    rows.append({"turn": turn, "error": f"{type(exc).__name__}: {short(str(exc), 200)}"})
                    break
                rows.append({"turn": turn, "cache": cache, "reused": reused, "prompt": t["usage"].prompt_tokens,
                             "cached": t["usage"].prompt_tokens_details.cached_tokens, "error": None})  # fmt: skip
                msgs.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
                ]})  # fmt: skip
                result = f"src/mod_{turn}.py:{10 + turn}: def handler_{turn}(request): return {turn}"
                msgs.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            self.data["agent"] = rows
            self.data["agent-wall"] = time.perf_counter() - t0
            errors = [r for r in rows if r["error"]]
            ok(not errors, f"turn {errors[0]['turn']} failed: {errors[0]['error']}" if errors else "")
            ok(len(rows) == turns, f"{len(rows)} turns")
            return f"{turns} turns in {self.data['agent-wall']:.1f}s, last prompt {rows[-1]['prompt']} tokens"

        def hits() -> str:
            rows = self.need("agent")
            bad = [(r["turn"], r.get("cache")) for r in rows[1:] if r.get("cache") not in HITS]
            ok(not bad, f"later turns not hits: {bad}")
            wrong = [r["turn"] for r in rows if not r["error"] and r["cached"] != r["reused"]]
            ok(not wrong, f"cached_tokens != Reused-Tokens at turns {wrong}")
            return "every turn after the first a hit"

        def grows() -> str:
            rows = [r for r in self.need("agent") if not r["error"]]
            reused = [r["reused"] for r in rows]
            shrink = [
                (i, reused[i - 1], reused[i]) for i in range(2, len(reused)) if reused[i] <= reused[i - 1]
            ]
            ok(not shrink, f"reuse did not grow at (turn, before, now): {shrink}; all {reused}")
            shares = [round(r["reused"] / r["prompt"], 2) for r in rows]
            late = shares[5:]
            ok(not late or min(late) >= 0.7, f"reused share below 70% from turn 5 on: {shares}")
            return f"reused per turn {reused}; share {shares}"

        self.checks(
            9,
            [
                (f"agent loop: {turns} turns of forced tool calls + tool results all succeed", loop),
                ("agent loop: every later turn a hit, cached_tokens == reused", hits),
                ("agent loop: reuse grows every turn, >= 70% of the prompt from turn 5", grows),
            ],
        )

    # -- 10. pass-through ---------------------------------------------------------------------------------

    def s10(self) -> None:
        c = self.oa
        sid = self.sid("upstream")

        def upstream_headers(h: dict[str, str]) -> None:
            ok(h.get("x-attentionstore-route") == "upstream", f"route {h.get('x-attentionstore-route')!r}")

        def chat_json() -> str:
            if self.upstream:
                self.http("POST", self.upstream + "/_trial/reset", b"{}")
            t = self.chat(
                [{"role": "user", "content": "hi"}], session=sid, model=UPSTREAM_MODEL, max_tokens=8
            )
            h = t["headers"]
            upstream_headers(h)
            ok(h.get("x-attentionstore-cache") == "bypass", f"cache {h.get('x-attentionstore-cache')!r}")
            ok(h.get("x-attentionstore-session") == sid, f"session {h.get('x-attentionstore-session')!r}")
            ok(t["content"] == FAKE_TEXT, f"content {t['content']!r}")
            sent = [r for r in self.upstream_requests() if r["path"] == "/v1/chat/completions"]
            ok(sent and sent[-1]["model"] == UPSTREAM_MODEL, f"the fake upstream got {sent[-1:]}")
            ok(
                "session_id" not in (sent[-1]["keys"] or []),
                f"session_id reached the upstream: {sent[-1]['keys']}",
            )
            return "answered by the fake upstream, session_id stripped"

        def chat_stream() -> str:
            t = self.chat(
                [{"role": "user", "content": "hi"}],
                session=sid,
                model=UPSTREAM_MODEL,
                stream=True,
                max_tokens=8,
            )
            upstream_headers(t["headers"])
            ok(t["content"] == FAKE_TEXT, f"content {t['content']!r}")
            ok(t["usage"] is not None, "no usage chunk passed through")
            return "streamed through"

        def embeddings() -> str:
            raw = c.embeddings.with_raw_response.create(
                model="text-embedding-fake", input="hello", encoding_format="float"
            )
            done = raw.parse()
            upstream_headers(hdrs(raw.headers))
            ok(done.data[0].embedding == [0.25, -0.5, 1.0], f"embedding {done.data[0].embedding}")
            sent = [r for r in self.upstream_requests() if r["path"] == "/v1/embeddings"]
            ok(sent, "the fake upstream got no /v1/embeddings")
            return "passed through"

        def completions_upstream() -> str:
            raw = c.completions.with_raw_response.create(model=UPSTREAM_MODEL, prompt="hi", max_tokens=8)
            upstream_headers(hdrs(raw.headers))
            ok(raw.parse().choices[0].text == FAKE_TEXT, "not the fake's text")
            return "passed through"

        def moderations() -> str:
            raw = c.moderations.with_raw_response.create(model="omni-moderation-fake", input="hello")
            upstream_headers(hdrs(raw.headers))
            ok(raw.parse().results[0].flagged is False, "unexpected moderation result")
            return "passed through"

        def models() -> str:
            ids = {m.id for m in c.models.list()}
            want = {LOCAL, TOOLS_MODEL, UPSTREAM_MODEL}
            ok(want <= ids, f"/v1/models lists {sorted(ids)}, missing {sorted(want - ids)}")
            return f"{sorted(ids)}"

        self.checks(
            10,
            [
                ("chat for the upstream model, non-stream: upstream, bypass, session_id stripped", chat_json),
                ("chat for the upstream model, streamed", chat_stream),
                ("/v1/embeddings passes through", embeddings),
                ("/v1/completions for the upstream model passes through", completions_upstream),
                ("/v1/moderations passes through", moderations),
                ("/v1/models lists the local models and the upstream's", models),
            ],
        )

    # -- 11. errors ---------------------------------------------------------------------------------------

    def s11(self) -> None:
        url = self.base + "/v1/chat/completions"
        auth = {"Authorization": f"Bearer {self.key}"}

        def error_object(raw: bytes) -> dict:
            doc = json.loads(raw)
            err = doc.get("error")
            ok(
                isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err),
                f"not an OpenAI error object: {doc}",
            )
            return err

        def bad_json() -> str:
            status, h, raw = self.http("POST", url, b"{not json", auth)
            ok(status == 400, f"status {status}")
            err = error_object(raw)
            ok(err["code"] == "invalid_json", f"code {err['code']!r}")
            ok("x-attentionstore-route" in h, "no X-AttentionStore-Route on the error")
            return f"{err['message']!r}"

        def unknown_model() -> str:
            if self.upstream:
                self.http("POST", self.upstream + "/_trial/reset", b"{}")
            body = {
                "model": "no-such-model-trial",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
            }
            status, h, raw = self.http("POST", url, body, auth)
            ok(status == 200, f"status {status}: {raw[:200]!r}")
            ok(h.get("x-attentionstore-route") == "upstream", f"route {h.get('x-attentionstore-route')!r}")
            sent = [r for r in self.upstream_requests() if r["path"] == "/v1/chat/completions"]
            ok(sent and sent[-1]["model"] == "no-such-model-trial", f"fake upstream got {sent[-1:]}")
            return "forwarded to the upstream"

        def negative_max_tokens() -> str:
            body = {"model": LOCAL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}
            status, h, raw = self.http("POST", url, body, auth)
            ok(status == 400, f"status {status}: {raw[:200]!r}")
            err = error_object(raw)
            ok(err["param"] == "max_tokens", f"param {err['param']!r}")
            missing = [
                n
                for n in ("x-attentionstore-route", "x-attentionstore-cache", "x-attentionstore-session")
                if n not in h
            ]
            ok(not missing, f"error answer lacks {missing}")
            try:
                self.oa.chat.completions.create(
                    model=LOCAL, messages=[{"role": "user", "content": "hi"}], max_tokens=-1
                )
            except openai.BadRequestError:
                pass
            else:
                raise Failed("the openai client did not raise BadRequestError")
            return f"{err['message']!r}"

        def missing_messages() -> str:
            status, _, raw = self.http("POST", url, {"model": LOCAL}, auth)
            ok(status == 400, f"status {status}")
            err = error_object(raw)
            ok(err["param"] == "messages", f"param {err['param']!r}")
            return f"{err['code']!r}"

        def stream_options_without_stream() -> str:
            body = {
                "model": LOCAL,
                "messages": [{"role": "user", "content": "hi"}],
                "stream_options": {"include_usage": True},
            }
            status, _, raw = self.http("POST", url, body, auth)
            ok(status == 400, f"status {status}: {raw[:200]!r}")
            err = error_object(raw)
            ok(err["param"] == "stream_options", f"param {err['param']!r}")
            return f"{err['message']!r}"

        def still_alive() -> str:
            status, _, body = self.http("GET", self.base + "/healthz")
            ok(status == 200, f"healthz {status}")
            t = self.chat([{"role": "user", "content": "Say hi."}], session=None, max_tokens=4)
            self.local_headers(t["headers"])
            return "healthz 200, a local turn answers"

        self.checks(
            11,
            [
                ("bad JSON body: 400, OpenAI error object, code invalid_json", bad_json),
                ("unknown model with an upstream: forwarded", unknown_model),
                (
                    "max_tokens -1 on the local model: 400 naming max_tokens, headers present",
                    negative_max_tokens,
                ),
                ("no messages: 400 naming messages", missing_messages),
                ("stream_options without stream: OpenAI's 400 naming it", stream_options_without_stream),
                ("after the bad inputs the server still serves", still_alive),
            ],
        )

    # -- 12. store endpoints, metrics, log -------------------------------------------------------------------

    def s12(self) -> None:
        def stats() -> str:
            status, _, raw = self.http("GET", self.base + "/v1/attention_store/stats")
            ok(status == 200, f"status {status}")
            doc = json.loads(raw)
            tiers = doc.get("tiers") or {}
            for tier in ("l0", "l1", "l2"):
                t = tiers.get(tier)
                ok(
                    isinstance(t, dict) and {"used_bytes", "capacity_bytes", "entries"} <= set(t),
                    f"tiers.{tier} = {t}",
                )
            for key in ("hits", "misses", "evictions", "bytes_loaded", "bytes_saved", "saves_pending"):
                ok(key in doc, f"no {key!r} in stats (keys {sorted(doc)})")
            return (
                f"entries l0={tiers['l0']['entries']} l1={tiers['l1']['entries']} l2={tiers['l2']['entries']} "
                f"hits={doc['hits']} misses={doc['misses']}"
            )

        def metrics() -> str:
            status, h, raw = self.http("GET", self.base + "/metrics")
            ok(status == 200, f"status {status}")
            text = raw.decode()
            ok(h.get("content-type", "").startswith("text/plain"), f"content-type {h.get('content-type')!r}")
            ok("attnstore_chat_requests_total" in text, "no attnstore_chat_requests_total")
            return f"{len(text.splitlines())} lines"

        def forget_session() -> str:
            sid = self.sid("chat-json")
            status, _, raw = self.http(
                "DELETE",
                f"{self.base}/v1/attention_store/sessions/{sid}",
                headers={"Authorization": f"Bearer {self.key}"},
            )
            ok(status == 200, f"status {status}: {raw[:200]!r}")
            doc = json.loads(raw)
            if "chat-json-1" in self.data:
                ok(doc.get("deleted") is True, f"answer {doc}")
            return f"{doc}"

        def log() -> str:
            if not self.args.log:
                raise Skip("no --log given")
            with open(self.args.log, encoding="utf-8", errors="replace") as f:
                text = f.read()
            lines = LOG_LINE.findall(text)
            ok(lines, "no [AttentionStore] session=... lines in the log")
            leaked = [k for k in self.keys_used if k in text]
            ok(not leaked, f"API keys in the log: {leaked}")
            mine = [ln for ln in lines if ln[0] == self.sid("chat-json")]
            if "chat-json-2" in self.data:
                ok(
                    any(ln[1] == "1" and ln[2] in HITS for ln in mine),
                    f"no turn=1 hit line for {self.sid('chat-json')}: {mine}",
                )
            tracebacks = text.count("Traceback (most recent call last)")
            ok(tracebacks == 0, f"{tracebacks} tracebacks in the server log")
            return f"{len(lines)} turn lines, no keys, no tracebacks"

        self.checks(
            12,
            [
                ("GET /v1/attention_store/stats: per tier used/capacity/entries, hits, misses", stats),
                ("GET /metrics: Prometheus text", metrics),
                ("DELETE /v1/attention_store/sessions/{id}", forget_session),
                ("server log: [AttentionStore] lines, no API keys, no tracebacks", log),
            ],
        )


NEEDS = {3: {2}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the proxy, without /v1")
    p.add_argument("--upstream", default="", help="the fake upstream ('' if none)")
    p.add_argument("--label", default="")
    p.add_argument("--log", default="", help="the server's log file (section 12 reads it)")
    p.add_argument("--only", default="", help="comma-separated sections")
    p.add_argument("--skip", default="", help="comma-separated sections")
    p.add_argument("--timeout", type=float, default=300, help="per request, seconds")
    p.add_argument("--ready-timeout", type=float, default=120, help="how long to wait for /healthz")
    p.add_argument("--agent-turns", type=int, default=25)
    args = p.parse_args()

    sections = set(range(1, 13))
    if args.only:
        sections = {int(s) for s in args.only.split(",") if s.strip()}
        for s in list(sections):
            sections |= NEEDS.get(s, set())
    sections -= {int(s) for s in args.skip.split(",") if s.strip()}
    if 1 not in sections:
        sections.add(1)  # readiness first, always

    trial = Trial(args)
    print(
        f"attnstore trial {args.label or ''} against {trial.base} (run {trial.run}), sections {sorted(sections)}",
        flush=True,
    )
    t0 = time.perf_counter()
    for s in sorted(sections):
        getattr(trial, f"s{s}")()
        if s == 1 and any(r[2] != "PASS" for r in trial.results):
            print("the server is not ready: stopping", flush=True)
            break
    wall = time.perf_counter() - t0

    counts = {k: sum(1 for r in trial.results if r[2] == k) for k in ("PASS", "FAIL", "SKIP")}
    print("=" * 78)
    print(f"SUMMARY {args.label}: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"of {len(trial.results)} checks in {wall:.0f}s")  # fmt: skip
    for section, name, status, detail in trial.results:
        if status != "PASS":
            print(f"  {status} [{section}] {name}: {detail}")
    return 0 if counts["FAIL"] == 0 and counts["SKIP"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
