"""The fake OpenAI upstream of the tests: `bench.support.fake_upstream`'s (chat completions and the model
list, the part the benchmarks need), plus the rest of the API that the proxy passes through, answered as
OpenAI would: embeddings, moderations, files, legacy completions and responses (JSON, or a stream of
events), Anthropic's messages and count_tokens (JSON), audio speech (binary, streamed) and transcriptions (a multipart upload read as it arrives), and an
OpenAI-style 404 `Invalid URL` for any other method and path.

Knobs on top of the base's (`mode` "hang" / "error" apply to every path):

- `upload_started`: set when a transcription upload's first body bytes arrive (before its last, when
  whoever sends it streams); `upload_cut`: set when the upload broke off before its end.
- `hold_stream`: when set to an Event, a streamed response waits for it after its first event.
- `speech_chunks` (with the base's `chunk_delay_s` before each): the audio answer's length.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from bench.support.fake_upstream import ANSWER_WORDS, Recorded
from bench.support.fake_upstream import FakeUpstream as ChatFakeUpstream

__all__ = ["ANSWERS", "ANSWER_WORDS", "FakeUpstream", "Recorded", "SPEECH_CHUNK", "TEXT"]

TEXT = "".join(ANSWER_WORDS)
USAGE = {"prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17}
RESPONSE: dict[str, Any] = {
    "id": "resp_fake",
    "object": "response",
    "created_at": 0,
    "status": "completed",
    "model": "gpt-fake",
    "output": [
        {
            "type": "message",
            "id": "msg_fake",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": TEXT, "annotations": []}],
        }
    ],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "usage": {
        "input_tokens": 11,
        "output_tokens": 6,
        "total_tokens": 17,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    },
}
# What each (method, path) answers, as OpenAI documents the shapes.
ANSWERS: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/embeddings"): {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5, 1.0]}],
        "model": "text-embedding-fake",
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    },
    ("POST", "/v1/moderations"): {
        "id": "modr-fake",
        "model": "omni-moderation-fake",
        "results": [
            {
                "flagged": False,
                "categories": {"harassment": False, "violence": False},
                "category_scores": {"harassment": 0.001, "violence": 0.002},
            }
        ],
    },
    ("GET", "/v1/files"): {
        "object": "list",
        "data": [
            {
                "id": "file-abc123",
                "object": "file",
                "bytes": 120,
                "created_at": 0,
                "filename": "batch.jsonl",
                "purpose": "batch",
                "status": "processed",
            }
        ],
        "has_more": False,
    },
    ("POST", "/v1/completions"): {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 0,
        "model": "gpt-fake",
        "choices": [{"text": TEXT, "index": 0, "logprobs": None, "finish_reason": "stop"}],
        "usage": USAGE,
    },
    ("POST", "/v1/responses"): RESPONSE,
    ("POST", "/v1/audio/transcriptions"): {"text": TEXT},
    # Anthropic's Messages API, as an Anthropic-style upstream answers it.
    ("POST", "/v1/messages"): {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": "claude-fake",
        "content": [{"type": "text", "text": TEXT}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 5,
            "output_tokens": 6,
            "cache_read_input_tokens": 4,
            "cache_creation_input_tokens": 2,
        },
    },
    ("POST", "/v1/messages/count_tokens"): {"input_tokens": 11},
}
SPEECH_CHUNK = bytes(range(256)) * 64  # 16 KiB of "audio", every byte value


def _invalid_url(request: web.Request) -> web.Response:
    """OpenAI's answer to a path it does not have."""
    error = {"message": f"Invalid URL ({request.method} {request.path})", "type": "invalid_request_error"}
    body = orjson.dumps({"error": {**error, "param": None, "code": None}})
    return web.Response(status=404, body=body, content_type="application/json")


def _event(doc: dict[str, Any]) -> bytes:
    return f"event: {doc['type']}\n".encode() + b"data: " + orjson.dumps(doc) + b"\n\n"


@dataclass
class FakeUpstream(ChatFakeUpstream):
    speech_chunks: int = 4
    hold_stream: threading.Event | None = None
    upload_started: threading.Event = field(default_factory=threading.Event)
    upload_cut: threading.Event = field(default_factory=threading.Event)

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/v1/audio/transcriptions", self._transcription)
        app.router.add_post("/v1/audio/speech", self._speech)
        app.router.add_route("*", "/{tail:.*}", self._canned)
        return app

    def _record(self, request: web.Request, body: bytes) -> None:
        if self.record:
            self.requests.append(
                Recorded(request.method, request.path_qs, CIMultiDict(request.headers), body)
            )

    async def _misbehave(self) -> web.Response | None:
        """The base's `mode`, for every path: hang, or answer `error_status`."""
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "error":
            return web.Response(
                status=self.error_status, body=self.error_body, content_type="application/json"
            )
        return None

    async def _canned(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self._record(request, raw)
        if (early := await self._misbehave()) is not None:
            return early
        doc = ANSWERS.get((request.method, request.path))
        if doc is None:
            return _invalid_url(request)
        if request.path == "/v1/responses" and orjson.loads(raw).get("stream"):
            return await self._response_events(request)
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    async def _response_events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events = [
            {"type": "response.created", "response": {**RESPONSE, "status": "in_progress", "output": []}}
        ]
        events += [
            {"type": "response.output_text.delta", "item_id": "msg_fake", "output_index": 0}
            | {"content_index": 0, "delta": word, "logprobs": []}
            for word in ANSWER_WORDS
        ]
        events.append({"type": "response.completed", "response": RESPONSE})
        for i, doc in enumerate(events):
            await resp.write(_event({**doc, "sequence_number": i}))
            if i == 0 and self.hold_stream is not None:
                await asyncio.to_thread(self.hold_stream.wait, 30)
        await resp.write_eof()
        return resp

    async def _transcription(self, request: web.Request) -> web.Response:
        """The upload read chunk by chunk as it arrives (a proxy that buffers it sends it all at once)."""
        chunks: list[bytes] = []
        try:
            async for chunk in request.content.iter_any():
                self.upload_started.set()
                chunks.append(chunk)
        except (Exception, asyncio.CancelledError):
            self.upload_cut.set()  # the proxy dropped the connection mid-upload
            raise
        self._record(request, b"".join(chunks))
        if (early := await self._misbehave()) is not None:
            return early
        return web.Response(
            body=orjson.dumps(ANSWERS[("POST", "/v1/audio/transcriptions")]), content_type="application/json"
        )

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        self._record(request, await request.read())
        if (early := await self._misbehave()) is not None:
            return early
        resp = web.StreamResponse(headers={"Content-Type": "audio/mpeg"})
        await resp.prepare(request)
        try:
            for _ in range(self.speech_chunks):
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                await resp.write(SPEECH_CHUNK)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return resp
