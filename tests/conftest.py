"""Shared fixtures for the proxy tests (and anyone else's tests that need a server or the fake upstream).

- `make_settings(**sections)`: Settings from the test defaults (local runner off, L2 under tmp_path, the
  fake upstream as llm_endpoint when `fake_upstream` is used) deep-merged with `sections`.
- `fake_upstream`: a running `tests.support.fake_upstream.FakeUpstream` (`.url`, `.requests`, knobs).
- `start_app(app_or_factory, **kw)`: start any aiohttp app in a background thread, stopped at teardown;
  returns a `tests.servers.AppServer` (`.url`).
- `start_proxy(settings=None, local_backend=None)`: build_app(settings) started the same way, with
  `local_backend` (a stand-in for `proxy.turns.backend.LocalBackend`) as its local serving.
- `proxy`: the proxy with default test settings in front of `fake_upstream`.
- `redis_server`: a throw-away redis-server on a free loopback port (skipped when the binary is absent).

Every test that uses the real model (the `smollm` or `load_smollm` fixture, directly or through another fixture) is marked
`model`, so `pytest -m "not model"` (make test-fast) runs exactly the model-free tests.
"""

from __future__ import annotations

import os

import torch

# Triton's kernels (local_runner/triton_attention.py, triton_ops.py) run in its interpreter where there is
# no GPU: the variable must be set before Triton is first imported (torch does not import it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import orjson  # noqa: E402
import pytest  # noqa: E402

from proxy.http.app import build_app, build_full_app  # noqa: E402
from proxy.settings import Settings, parse_settings  # noqa: E402
from proxy.turns.local_start import LOCAL_START  # noqa: E402
from tests.model_fixture import MODEL, load_smollm, smollm  # noqa: F401, E402 - the real model, once per session
from tests.servers import AppServer  # noqa: E402
from tests.support.fake_upstream import FakeUpstream  # noqa: E402
from tests.support.redis_server import REDIS_SERVER, RedisServer  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "smollm" in fixtures or "load_smollm" in fixtures:
            item.add_marker(pytest.mark.model)
        if "redis_server" in fixtures:
            item.add_marker(pytest.mark.redis)


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def settings_dict(tmp_path: Path, base_url: str = "") -> dict[str, Any]:
    return {
        "attention_store": {"tiering": {"l2_disk": {"path": str(tmp_path / "kv")}}},
        "llm_endpoint": {"base_url": base_url, "api_key_env": "ATTNSTORE_TEST_UPSTREAM_KEY", "model": ""},
        # compile off: a runner per test would compile for a minute (tests/test_compiled_step.py covers it)
        "local_runner": {"enabled": False, "compile": False},
        "proxy": {"host": "127.0.0.1", "port": 0},
    }


@pytest.fixture
def start_app() -> Iterator[Callable[..., AppServer]]:
    started: list[AppServer] = []

    def start(app: Any, **kwargs: Any) -> AppServer:
        """Started, and (an attnstore app) its local serving too: a test may ask the engine at once."""
        server = AppServer(app, **kwargs).start()
        started.append(server)
        if server.app is not None and LOCAL_START in server.app:
            server.call(server.app[LOCAL_START].wait(), timeout=300)
        return server

    yield start
    for server in reversed(started):
        server.stop()


@pytest.fixture
def fake_upstream(start_app) -> FakeUpstream:
    fake = FakeUpstream()
    fake.url = start_app(fake.app()).url
    return fake


@pytest.fixture
def make_settings(tmp_path: Path, request: pytest.FixtureRequest) -> Callable[..., Settings]:
    def make(**sections: Any) -> Settings:
        base_url = ""
        if "fake_upstream" in request.fixturenames:
            base_url = request.getfixturevalue("fake_upstream").url + "/v1"
        raw = deep_merge(settings_dict(tmp_path, base_url), sections)
        return parse_settings(orjson.dumps(raw), tmp_path, env={})

    return make


@pytest.fixture
def start_proxy(start_app, make_settings) -> Callable[..., AppServer]:
    def start(settings: Settings | None = None, local_backend: Any = None) -> AppServer:
        settings = settings or make_settings()
        local = None if local_backend is None else lambda: local_backend
        return start_app(build_app(settings, local=local))

    return start


@pytest.fixture
def proxy(fake_upstream, start_proxy) -> AppServer:
    return start_proxy()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed on this machine (apt-get install redis-server)")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def local_proxy(start_app, make_settings, smollm):  # noqa: F811 - smollm is the fixture imported above
    """start(**sections) -> AppServer: the proxy serving the real model locally, with these settings
    (a test module may define its own, e.g. with smaller KV chunks)."""

    def start(**sections):
        lr = {"enabled": True, **sections.pop("local_runner", {})}
        return start_app(build_full_app(make_settings(local_runner=lr, **sections), models={MODEL: smollm}))

    return start
