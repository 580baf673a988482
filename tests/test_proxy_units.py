import ast
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.errors import APIError
from proxy.metrics import Metrics
from proxy.openai.requests import count_turn
from proxy.turns.headers import CACHE, TIER_NAMES, cache_label
from proxy.turns.session import prefix_fingerprint, resolve_session
from proxy.turns.tenant import check_client_auth, tenant_of
from proxy.turns.turn import Turn
from proxy.upstream.forward import prompt_tokens_from_sse_tail, upstream_url
from proxy.upstream.header_filter import outbound_headers

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("base", "path", "want"),
    [
        ("http://h:1/v1", "/v1/chat/completions", "http://h:1/v1/chat/completions"),
        ("http://h:1/v1/", "/v1/chat/completions", "http://h:1/v1/chat/completions"),
        ("http://h:1", "/v1/chat/completions", "http://h:1/v1/chat/completions"),
        ("http://h:1/openai", "/v1/models", "http://h:1/openai/v1/models"),
        ("http://h:1/v1", "/v1/chat/completions?x=1", "http://h:1/v1/chat/completions?x=1"),
    ],
)
def test_upstream_url(base, path, want):
    assert upstream_url(base, path) == want


CLIENT_HEADERS = {
    "Host": "proxy",
    "Content-Length": "5",
    "Connection": "keep-alive, X-Drop",
    "X-Drop": "1",
    "Transfer-Encoding": "chunked",
    "X-Session-Id": "s",
    "Authorization": "Bearer client",
    "OpenAI-Organization": "org",
}


def test_outbound_headers_to_the_upstream_drop_hop_by_hop_and_replace_the_key(make_settings, monkeypatch):
    settings = make_settings()
    assert dict(outbound_headers(CLIENT_HEADERS, settings, "upstream")) == {
        "Authorization": "Bearer client",  # no client keys here: the client's own key is the upstream's
        "OpenAI-Organization": "org",
    }
    monkeypatch.setenv("ATTNSTORE_TEST_UPSTREAM_KEY", "upstream-key")
    out = outbound_headers(CLIENT_HEADERS, settings, "upstream")
    assert dict(out) == {"Authorization": "Bearer upstream-key", "OpenAI-Organization": "org"}


@pytest.mark.parametrize("keys", [{"api_keys": ["client"]}, {"admin_keys": ["client"]}])
def test_outbound_headers_never_pass_a_proxy_key_upstream(make_settings, keys):
    out = outbound_headers(CLIENT_HEADERS, make_settings(proxy=keys), "upstream")
    assert dict(out) == {"OpenAI-Organization": "org"}


ANTHROPIC_CLIENT = {"x-api-key": "client", "anthropic-version": "2023-06-01", "anthropic-beta": "b"}


def test_the_upstream_key_goes_where_the_clients_api_sends_keys(make_settings, monkeypatch):
    """x-api-key on /v1/messages* (Anthropic's documented header), Authorization elsewhere, and also the
    header the client sent its key in; the anthropic-* headers pass; never a client key next to it."""
    settings = make_settings()
    assert dict(outbound_headers(ANTHROPIC_CLIENT, settings, "upstream", "/v1/messages")) == ANTHROPIC_CLIENT
    monkeypatch.setenv("ATTNSTORE_TEST_UPSTREAM_KEY", "upstream-key")
    out = outbound_headers(ANTHROPIC_CLIENT, settings, "upstream", "/v1/messages")
    assert dict(out) == {**ANTHROPIC_CLIENT, "x-api-key": "upstream-key"}
    bare = outbound_headers({}, settings, "upstream", "/v1/messages/count_tokens")
    assert dict(bare) == {"x-api-key": "upstream-key"}
    bearer = outbound_headers({"Authorization": "Bearer c"}, settings, "upstream", "/v1/messages")
    assert dict(bearer) == {"Authorization": "Bearer upstream-key", "x-api-key": "upstream-key"}
    assert dict(outbound_headers({}, settings, "upstream", "/v1/chat/completions")) == {
        "Authorization": "Bearer upstream-key"
    }
    elsewhere = outbound_headers({"x-api-key": "c"}, settings, "upstream", "/v1/models")
    assert dict(elsewhere) == {"Authorization": "Bearer upstream-key", "x-api-key": "upstream-key"}


def test_a_proxy_key_in_x_api_key_never_goes_upstream(make_settings):
    out = outbound_headers(ANTHROPIC_CLIENT, make_settings(proxy={"api_keys": ["client"]}), "upstream")
    assert "x-api-key" not in {k.lower() for k in out} and out["anthropic-version"] == "2023-06-01"


def test_x_api_key_authenticates_and_names_the_same_tenant_as_a_bearer_key():
    check_client_auth({"x-api-key": "k1"}, ["k1"])
    with pytest.raises(APIError) as refused:
        check_client_auth({"x-api-key": "nope"}, ["k1"])
    assert refused.value.status == 401
    assert tenant_of({"x-api-key": "k1"}) == tenant_of({"Authorization": "Bearer k1"}) != "anonymous"


def test_outbound_headers_to_a_replica_keep_the_key_and_the_session(make_settings, monkeypatch):
    monkeypatch.setenv("ATTNSTORE_TEST_UPSTREAM_KEY", "upstream-key")
    settings = make_settings(proxy={"api_keys": ["client"], "replica_id": "r1"})
    assert dict(outbound_headers(CLIENT_HEADERS, settings, "replica")) == {
        "X-Session-Id": "s",
        "Authorization": "Bearer client",  # the owner authenticates it and derives the same tenant
        "OpenAI-Organization": "org",
        "X-AttentionStore-Forwarded-By": "r1",
    }


def test_resolve_session_order_and_strip():
    body = {"model": "m", "messages": MSGS, "sid": "from-body"}
    assert resolve_session(body, {"X-Session-Id": "from-header"}, "sid") == "from-body"
    assert "sid" not in body
    assert resolve_session(body, {"X-Session-Id": "from-header"}, "sid") == "from-header"
    derived = resolve_session(body, {}, "sid")
    assert derived == prefix_fingerprint("m", MSGS)
    later = MSGS + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    assert prefix_fingerprint("m", later) == derived
    assert prefix_fingerprint("other", later) != derived
    assert prefix_fingerprint("m", [{"role": "user", "content": "different"}]) != derived


@pytest.mark.parametrize("bad", [123, "", "has space", "x" * 200, "new\nline"])
def test_resolve_session_rejects_bad_ids(bad):
    with pytest.raises(APIError) as err:
        resolve_session({"session_id": bad}, {}, "session_id")
    assert err.value.status == 400 and err.value.param == "session_id"


def test_count_turn():
    assert count_turn(MSGS) == 0
    assert (
        count_turn(MSGS + [{"role": "assistant"}, {"role": "user"}, {"role": "assistant"}, {"role": "user"}])
        == 2
    )
    assert count_turn([{"role": "system"}]) == 0


def test_tenant_and_auth():
    assert tenant_of({}) == "anonymous"
    t = tenant_of({"Authorization": "Bearer secret"})
    assert len(t) == 16 and "secret" not in t and t == tenant_of({"Authorization": "bearer secret"})
    check_client_auth({}, [])
    check_client_auth({"Authorization": "Bearer a"}, ["b", "a"])
    for headers in ({}, {"Authorization": "Bearer c"}, {"Authorization": "Basic a"}):
        with pytest.raises(APIError) as err:
            check_client_auth(headers, ["a"])
        assert err.value.status == 401


def test_prompt_tokens_from_sse_tail():
    tail = b'data: {"choices":[]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":42}}\n\ndata: [DONE]\n\n'
    assert prompt_tokens_from_sse_tail(tail) == 42
    assert prompt_tokens_from_sse_tail(b"data: [DONE]\n\n") == 0


def test_cache_labels_come_from_kvtiers_tiers():
    from kvtier import TIERS

    assert [cache_label(t) for t in TIERS] == ["l0_hit", "l1_hit", "l2_hit"]
    assert cache_label("miss") == "miss" and cache_label("bypass") == "bypass"
    assert TIER_NAMES == TIERS  # the header names every tier kvtier has, in its order
    turn = Turn(received_at=10.0, replica="r1", metrics=Metrics(), session="s")
    turn.serve_locally()
    turn.local_first_token(
        cache="l1", reused=32, prompt=40, tiers={"l0": 16, "l1": 16}, position_shift=0, at=10.001234
    )
    assert turn.headers() == {
        CACHE: "l1_hit",
        "X-AttentionStore-Route": "local",
        "X-AttentionStore-Reused-Tokens": "32",
        "X-AttentionStore-Session": "s",
        "X-AttentionStore-TTFT-Ms": "1.23",
        "X-AttentionStore-Replica": "r1",
        "X-AttentionStore-Tiers": "l0=16,l1=16,l2=0",
        "X-AttentionStore-Position-Shift": "0",
        "X-AttentionStore-Skipped-Tokens": "0",
    }
    turn.serve_upstream()
    upstream = turn.headers()
    assert "X-AttentionStore-Tiers" not in upstream and upstream["X-AttentionStore-Replica"] == "r1"
    assert upstream[CACHE] == "bypass" and upstream["X-AttentionStore-Route"] == "upstream"


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("proxy", "local_runner", "vllm_engine", "engine_api", "kvtier")  # attnstore's own, above to below
IN_VLLM = ("vllm_engine.connector", "vllm_engine.link")  # what vLLM's own processes import


def _imports(package: str) -> dict[str, set[str]]:
    """Every module of `package` -> the modules of attnstore's packages it imports (at the top, inside a
    function, or for type checking only), relative imports resolved."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        pkg = parts[:-1]
        if parts[-1] == "__init__":
            parts = pkg
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg[: len(pkg) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                deps.update([f"{target}.{a.name}" for a in node.names] if not node.module else [target])
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        own = {d for d in deps if d.split(".")[0] in PACKAGES}
        graph[".".join(parts)] = own - {".".join(parts)}
    return graph


def _proxy_imports() -> dict[str, set[str]]:
    """Every module of proxy/ -> the proxy modules it imports."""
    return {m: {d for d in deps if d.split(".")[0] == "proxy"} for m, deps in _imports("proxy").items()}


def _proxy_parts() -> dict[str, set[str]]:
    """proxy's parts (a subpackage such as proxy.http, or a module of proxy itself such as proxy.settings)
    -> the other parts they import."""
    parts: dict[str, set[str]] = {}
    for module, deps in _proxy_imports().items():
        part = ".".join(module.split(".")[:2])
        parts.setdefault(part, set()).update(".".join(d.split(".")[:2]) for d in deps)
    return {part: deps - {part} for part, deps in parts.items()}


def test_every_arrow_in_proxy_points_down():
    """proxy's parts import each other one way, so they stand in layers, each importing only layers below
    it: repeatedly take the parts whose imports are all taken. http/ is the roof: only the command line
    imports it. Only the app reaches into local serving (torch): everything else goes through
    proxy.turns.backend."""
    parts = _proxy_parts()
    assert {"proxy.http", "proxy.serving", "proxy.local", "proxy.errors", "proxy.metrics"} <= parts.keys()
    done: set[str] = set()
    while len(done) < len(parts):
        ready = {p for p, deps in parts.items() if p not in done and deps <= done}
        assert ready, f"an arrow runs back up among {sorted(set(parts) - done)}"
        done |= ready
    assert {p for p, deps in parts.items() if "proxy.http" in deps} == {"proxy.cli"}
    graph = _proxy_imports()
    reaching = {m for m, deps in graph.items() if any(d.startswith("proxy.local.") for d in deps)}
    assert {m for m in reaching if not m.startswith("proxy.local")} == {"proxy.http.app"}


def _importers(package: str, forbidden: set[str]) -> dict[str, set[str]]:
    """The modules of `package` that import one of the `forbidden` packages, with what they import."""
    found = {}
    for module, deps in _imports(package).items():
        bad = {d for d in deps if d.split(".")[0] in forbidden}
        if bad:
            found[module] = bad
    return found


def test_the_packages_import_one_way_proxy_then_the_engines_then_kvtier():
    """proxy -> the engines (local_runner, vllm_engine) -> engine_api -> kvtier, never back up: only the
    proxy imports the proxy; neither engine imports the other (what they share is engine_api's); the
    connector and its link (they run inside vLLM) import only kvtier; kvtier knows no engine at all."""
    assert {"engine_api.turn", "local_runner.jobs", "vllm_engine.engine", "vllm_engine.link.wire"} <= {
        m for p in PACKAGES for m in _imports(p)
    }
    assert _importers("local_runner", {"proxy", "vllm_engine"}) == {}
    assert _importers("vllm_engine", {"proxy", "local_runner"}) == {}
    assert _importers("engine_api", {"proxy", "local_runner", "vllm_engine"}) == {}
    in_vllm = {m: d for m, d in _imports("vllm_engine").items() if m.startswith(IN_VLLM)}
    assert "vllm_engine.connector" in in_vllm and "vllm_engine.link.worker" in in_vllm
    outside = {(m, d) for m, deps in in_vllm.items() for d in deps if not d.startswith(("kvtier", *IN_VLLM))}
    assert outside == set()
    assert _importers("kvtier", {"proxy", "engine_api", "local_runner", "vllm_engine"}) == {}
    mentions = [p for p in (ROOT / "kvtier").rglob("*.py") if "vllm" in p.read_text().lower()]
    assert mentions == [], "kvtier names no engine"


def test_an_upstream_only_proxy_loads_no_torch():
    """The proxy's core (tier names included, from kvtier's torch-free module) and the engine interface
    import without torch: an upstream-only proxy starts in a blink. Only proxy.local, built when local
    serving is on, loads it."""
    interface = ", ".join(f"engine_api.{p.stem}" for p in (ROOT / "engine_api").glob("*.py"))
    code = (
        f"import sys, proxy.http.app, proxy.cli, {interface}; "
        "sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_no_private_name_crosses_a_package():
    """A name with a leading underscore is imported only inside its own top-level package: what two
    packages share is public (engine_api's, for both engines)."""
    crossing = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            pkg = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
                    continue
                base = pkg[: len(pkg) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private and target.split(".")[0] != package:
                    crossing.append((str(path.relative_to(ROOT)), target, private))
    assert crossing == []
