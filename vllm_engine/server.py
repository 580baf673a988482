"""One vLLM OpenAI server as a child process group: started, waited for (saying so), stopped.

vLLM runs its API server, its engine core and its workers as separate processes; they share the process
group the server is started in, so stopping ends the whole group: SIGTERM to the server first (its
workers then shut down their connector, which finishes the store's pending writes), SIGKILL to every
process left after a grace period. The store is also asked to flush before that, so a restart finds
every chunk even when vLLM's own shutdown is cut short.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from engine_api.model_source import ModelLoadError

from .launch import Launch
from .link.wire import StoreClient, StoreError, StoreUnavailable

log = logging.getLogger("attnstore")
REQUIRED_MODULES = ("vllm", "xxhash", "safetensors", "msgspec")  # vLLM, and what the connector imports


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_vllm_python(python: str) -> None:
    """The interpreter can import vLLM and the connector's own dependencies (without importing them)."""
    code = "import importlib.util as u, sys; sys.exit(','.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
    if python == sys.executable:
        missing = [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]
    else:
        run = subprocess.run(
            [python, "-c", code, *REQUIRED_MODULES], capture_output=True, text=True, timeout=60
        )
        missing = (
            [m for m in (run.stderr.strip().splitlines() or [""])[-1].split(",") if m]
            if run.returncode
            else []
        )
    if missing:
        raise ModelLoadError(
            f"local_runner.vllm_python {python}: cannot import {', '.join(missing)} "
            f"(make vllm builds .venv-vllm with all of them; see docs/vllm.md)"
        )


class VllmServer:
    def __init__(self, name: str, launch: Launch, port: int, log_path: Path) -> None:
        self.name = name
        self.launch = launch
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.store = StoreClient(launch.socket_path, timeout_s=60) if launch.socket_path else None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            launch.argv,
            env=launch.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() ends vLLM's engine and workers too
        )
        atexit.register(self.stop)  # an interpreter that exits without closing the backend still stops it
        log.info("model %s: starting vLLM on %s (pid %d, log %s)", name, self.url, self.proc.pid, log_path)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until vLLM answers /v1/models (and its store its socket); ModelLoadError if it exits or
        the time runs out (the log's last lines say why)."""
        deadline = self.started_at + timeout_s
        said = 0.0
        while True:
            if self.proc.poll() is not None:
                raise ModelLoadError(
                    f"vLLM for {self.name} exited ({self.proc.returncode}): {self.log_tail()}"
                )
            if self._answers():
                break
            now = time.monotonic()
            if now > deadline:
                self.stop()
                raise ModelLoadError(
                    f"vLLM for {self.name} not ready after {timeout_s:.0f} s: {self.log_tail()}"
                )
            if now - said >= 30:
                said = now
                log.info("model %s: waiting for vLLM (%.0f s so far)", self.name, now - self.started_at)
            time.sleep(0.5)
        log.info("model %s: vLLM ready after %.1f s", self.name, time.monotonic() - self.started_at)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as resp:
                if resp.status != 200:
                    return False
        except (urllib.error.URLError, OSError):
            return False
        if self.store is None:
            return True
        try:
            self.store.call("stats")
        except (StoreUnavailable, StoreError):
            return False
        return True

    def log_tail(self, lines: int = 4) -> str:
        """The log's last error line (vLLM's reason, above its traceback), then its last lines."""
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        errors = [line for line in text if "Error: " in line and "Warning" not in line]
        tail = " | ".join(text[-lines:])
        return (
            f"{errors[-1].strip()} (log {self.log_path}: ... {tail})"
            if errors
            else f"{tail} (log {self.log_path})"
        )

    def stop(self, grace_s: float = 30.0) -> None:
        """Flush the store, then end the process group (idempotent)."""
        atexit.unregister(self.stop)
        if self.proc.poll() is None and self.store is not None:
            with contextlib.suppress(StoreUnavailable, StoreError):
                self.store.call("flush", timeout_s=grace_s)
        if self.store is not None:
            self.store.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of vLLM's processes is left
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()
