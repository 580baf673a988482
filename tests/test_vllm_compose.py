"""docker-compose.yml's `vllm` profile, checked as data: attnstore on vLLM (GPU image) beside the
replicas, only with its profile, on loopback, with client keys, Redis, the shared L2 volume, a GPU, and
settings the proxy accepts for the vLLM engine."""

from __future__ import annotations

from pathlib import Path

import yaml

from proxy.cli import parser
from proxy.settings import parse_settings

REPO = Path(__file__).resolve().parent.parent


def service() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["attnstore-vllm"]


def test_the_vllm_profile_serves_on_vllm_with_the_shared_store():
    svc = service()
    assert svc["profiles"] == ["vllm"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
    settings = parse_settings(
        (REPO / mounts["/etc/attnstore/settings.json"]).read_bytes(), check_paths=False, env={}
    )
    assert settings.local_runner.engine == "vllm" and settings.local_runner.vllm_python == ""
    assert mounts[settings.attention_store.tiering.l2_disk.path] == "kv-l2"
    assert mounts[settings.local_runner.cache_dir] == "models"
    assert svc["environment"]["ATTNSTORE_REDIS_URL"].startswith("redis://redis")
    assert svc["env_file"] == ["deploy/attnstore.env"]  # bound to 0.0.0.0: client keys required
    assert svc["ports"] == ["${ATTNSTORE_VLLM_PUBLISH:-127.0.0.1}:${ATTNSTORE_VLLM_PORT:-8090}:8080"]
    assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert parser().parse_args(svc["command"][1:]).port == 8080


def test_the_image_is_vllms_own_with_the_pinned_release():
    dockerfile = (REPO / service()["build"]["dockerfile"]).read_text()
    assert "FROM vllm/vllm-openai:v0.32.0" in dockerfile
    assert 'CMD ["attnstore", "serve"' in dockerfile and "ENTRYPOINT []" in dockerfile


def test_both_images_hold_the_proxy_both_engines_and_the_store():
    """vllm_engine/ sits beside local_runner/ and kvtier/: an image without it could not serve on vLLM."""
    for dockerfile in (REPO / "Dockerfile", REPO / service()["build"]["dockerfile"]):
        text = dockerfile.read_text()
        for package in ("proxy", "local_runner", "vllm_engine", "kvtier"):
            assert f"COPY {package} ./{package}" in text, (dockerfile.name, package)
