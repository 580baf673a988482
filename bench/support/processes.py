"""Processes the multi-replica tests and benchmarks start on loopback: `python -m proxy serve` replicas as
docker-compose runs them, and HAProxy with the compose file's own config (deploy/haproxy.cfg).

Each class starts in its constructor (or `start()`), `wait_ready()` polls until it answers, and `stop()`
ends it (terminate, then kill), safe to call twice. Use them in a try/finally or a fixture."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import urllib3

from .threaded_server import free_port
from .waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
HAPROXY_CFG = REPO / "deploy" / "haproxy.cfg"
HAPROXY = shutil.which("haproxy") or next(
    (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None
)
# A process still starting, or a connection refused: not ready yet.
UNREACHABLE = (urllib3.exceptions.HTTPError, OSError)


def _end(proc: subprocess.Popen, grace_s: float = 20) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class ReplicaProcess:
    """`python -m proxy serve --settings <file> --port <free port>` with `settings` (a dict) and
    `env` added to this process's environment (ATTNSTORE_* variables of the caller's are not inherited).
    `advertise`: its own URL as ATTNSTORE_ADVERTISE_URL (with a Redis index: heartbeat and forwarding)."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        settings: dict[str, Any],
        env: dict[str, str] | None = None,
        *,
        advertise: bool = False,
    ):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**(env or {}), **({"ATTNSTORE_ADVERTISE_URL": self.url} if advertise else {})}
        self.settings_file = workdir / f"{name}.json"
        self.settings_file.write_bytes(orjson.dumps(settings))
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        base = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSTORE_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--settings", str(self.settings_file)]
            + ["--port", str(self.port)],
            cwd=workdir,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**base, "PYTHONPATH": str(REPO), **env},
        )

    def wait_ready(self, timeout: float = 120) -> ReplicaProcess:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.log_tail()}")
            return urllib3.request("GET", self.url + "/healthz", timeout=1, retries=False).status == 200

        wait_until(up, self.name, timeout, interval=0.1, ignore=UNREACHABLE)
        return self

    def log_tail(self, n: int = 2000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def kill(self) -> None:
        """kill -9: no cleanup, its heartbeat stays in Redis until it expires."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        _end(self.proc)
        self._log.close()


class HAProxy:
    """HAProxy in the foreground on 127.0.0.1:<free port> with deploy/haproxy.cfg, the replicas'
    addresses given as the environment variables the config expands."""

    def __init__(self, workdir: Path, replica_a: str, replica_b: str):
        assert HAPROXY is not None, "haproxy is not installed"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "ATTNSTORE_LB_BIND": f"127.0.0.1:{self.port}",
            "ATTNSTORE_REPLICA_A": replica_a,
            "ATTNSTORE_REPLICA_B": replica_b,
        }
        self.log_path = workdir / "haproxy.log"
        self._log = self.log_path.open("wb")
        check = subprocess.run(
            [HAPROXY, "-c", "-q", "-f", str(HAPROXY_CFG)], env=self.env, capture_output=True, text=True
        )
        if check.returncode != 0:
            raise RuntimeError(f"deploy/haproxy.cfg is invalid: {check.stdout}{check.stderr}")
        self.proc = subprocess.Popen(
            [HAPROXY, "-db", "-f", str(HAPROXY_CFG)],
            cwd=workdir,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 30) -> HAProxy:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited ({self.proc.returncode}): {self.log_path.read_text()}")
            return urllib3.request("GET", self.url + "/healthz", timeout=1, retries=False).status == 200

        wait_until(up, "haproxy", timeout, interval=0.1, ignore=UNREACHABLE)
        return self

    def stop(self) -> None:
        _end(self.proc, grace_s=5)
        self._log.close()
