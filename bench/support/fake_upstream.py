"""A fake OpenAI-compatible upstream for tests and benchmarks (no model, no network beyond loopback).

    fake = FakeUpstream()                 # knobs: see the attributes below; change them at any time
    app = fake.app()                      # an aiohttp Application: POST /v1/chat/completions, GET /v1/models
    fake.requests[-1].json                # what the last chat request carried (path, headers, body)

`python -m bench.support.fake_upstream --port P` serves it standalone (used by bench.proxy_overhead).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

ANSWER_WORDS = ["Hello", " from", " the", " fake", " upstream", "."]


@dataclass
class Recorded:
    method: str
    path: str
    headers: CIMultiDict[str]  # case-insensitive
    body: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class FakeUpstream:
    # Behaviour of POST /v1/chat/completions: "ok", "error" (error_status + error_body) or "hang".
    mode: str = "ok"
    error_status: int = 429
    error_body: bytes = orjson.dumps(
        {
            "error": {
                "message": "Rate limit reached",
                "type": "rate_limit_error",
                "param": None,
                "code": "rate",
            }
        }
    )
    chunk_delay_s: float = 0.0  # pause before each streamed chunk
    n_chunks: int = 0  # streamed content chunks; 0 = one per answer word
    stall_after: int = -1  # >= 0: a stream goes silent forever after this many events
    prompt_tokens: int = 11
    models: list[str] = field(default_factory=lambda: ["gpt-fake"])
    models_delay_s: float = 0.0
    record: bool = True  # off for benchmarks
    url: str = ""  # set by whoever serves it (tests' fixture): base URL without /v1
    requests: list[Recorded] = field(default_factory=list)
    # Set when a streaming answer was cut off because the client (the proxy) closed the connection.
    disconnected: threading.Event = field(default_factory=threading.Event)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if self.record:
            self.requests.append(Recorded(request.method, request.path_qs, CIMultiDict(request.headers), raw))
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "error":
            return web.Response(
                status=self.error_status, body=self.error_body, content_type="application/json"
            )
        body = orjson.loads(raw)
        model = body.get("model", "gpt-fake")
        words = ANSWER_WORDS if not self.n_chunks else [f"w{i} " for i in range(self.n_chunks)]
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(words)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if not body.get("stream"):
            doc = {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(words)},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
            return web.Response(body=orjson.dumps(doc), content_type="application/json")
        return await self._stream(request, model, words, usage, body)

    async def _stream(self, request, model, words, usage, body) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model}
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        events += [{**base, "choices": [{"index": 0, "delta": {"content": w}}]} for w in words]
        events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        if include_usage:
            events.append({**base, "choices": [], "usage": usage})
        try:
            for i, ev in enumerate(events):
                if i == self.stall_after:
                    await asyncio.sleep(3600)
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                await resp.write(b"data: " + orjson.dumps(ev) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        if self.record:
            self.requests.append(Recorded(request.method, request.path_qs, CIMultiDict(request.headers), b""))
        if self.models_delay_s:
            await asyncio.sleep(self.models_delay_s)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.models]
        return web.Response(
            body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="serve the fake OpenAI upstream")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    web.run_app(FakeUpstream(record=False).app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
