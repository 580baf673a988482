"""The trial's fake OpenAI upstream: the test suite's own (tests/support/fake_upstream.py: chat completions
streamed and not, /v1/models, embeddings, completions, responses, messages, ... as OpenAI answers them),
served standalone on a port, plus one trial-only endpoint so that trial.py (another process) can see what
reached the upstream:

    GET  /_trial/requests   -> [{"method", "path", "model", "keys", "headers"}, ...]  (oldest first)
    POST /_trial/reset      -> forget them

Run from the repository's root (it imports tests.support.fake_upstream):

    PYTHONPATH=. .venv/bin/python tests/trial/fake_upstream.py --port PORT
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import orjson
from aiohttp import web

from bench.support.fake_upstream import FakeUpstream as ChatFakeUpstream
from tests.support.fake_upstream import FakeUpstream

# Headers worth showing the trial (never the whole set: keep the answer small).
SHOWN_HEADERS = ("authorization", "x-api-key", "x-session-id", "content-type")


@dataclass
class TrialUpstream(FakeUpstream):
    def app(self) -> web.Application:
        # The test fake's routes, with the trial's two inserted before its catch-all route (which would
        # otherwise answer them with a 404).
        app = ChatFakeUpstream.app(self)  # POST /v1/chat/completions, GET /v1/models
        app.router.add_get("/_trial/requests", self._trial_requests)
        app.router.add_post("/_trial/reset", self._trial_reset)
        app.router.add_post("/v1/audio/transcriptions", self._transcription)
        app.router.add_post("/v1/audio/speech", self._speech)
        app.router.add_route("*", "/{tail:.*}", self._canned)
        return app

    async def _trial_requests(self, request: web.Request) -> web.Response:
        out = []
        for rec in self.requests:
            model, keys = None, None
            if rec.body:
                try:
                    doc = orjson.loads(rec.body)
                except orjson.JSONDecodeError:
                    doc = None
                if isinstance(doc, dict):
                    model, keys = doc.get("model"), sorted(doc)
            headers = {k.lower(): v for k, v in rec.headers.items() if k.lower() in SHOWN_HEADERS}
            out.append(
                {"method": rec.method, "path": rec.path, "model": model, "keys": keys, "headers": headers}
            )
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    async def _trial_reset(self, request: web.Request) -> web.Response:
        self.requests.clear()
        return web.Response(body=b"{}", content_type="application/json")


def main() -> None:
    p = argparse.ArgumentParser(description="the trial's fake OpenAI upstream")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    fake = TrialUpstream(record=True, models=["gpt-fake"])
    fake.url = f"http://{args.host}:{args.port}"
    web.run_app(fake.app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
