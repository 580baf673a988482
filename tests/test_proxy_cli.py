"""The process: `python -m proxy serve` starts and answers; a bad settings file exits 2 with one line."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from proxy.settings import make_l2_folder, parse_settings
from tests.conftest import settings_dict
from tests.servers import http_request
from tests.support.threaded_server import free_port
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd, timeout=60, env=None):
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def test_bad_settings_exit_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    raw = settings_dict(tmp_path)
    raw["attention_store"]["tiering"]["l0_gpu"] = {"capacity_mb": -5}
    bad.write_bytes(orjson.dumps(raw))
    r = run_cli("serve", "--settings", str(bad), cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "attention_store.tiering.l0_gpu.capacity_mb" in lines[0]


def test_unknown_key_and_missing_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_bytes(orjson.dumps({"proxy": {"prot": 1}}))
    r = run_cli("serve", cwd=tmp_path, env={"ATTNSTORE_SETTINGS": str(bad)})
    assert r.returncode == 2 and "prot" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("serve", "--settings", str(tmp_path / "missing.json"), cwd=tmp_path)
    assert r.returncode == 2 and "missing.json" in r.stderr


def test_bench_subcommand_runs_the_benchmark(tmp_path):
    r = run_cli("bench", "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: attnstore bench") and "--conversations" in r.stdout


@pytest.mark.parametrize("absent", ["bench", "matplotlib", "tqdm"])
def test_bench_subcommand_without_the_extra_says_how_to_install_it(tmp_path, absent):
    """The `bench` extra (its code or a package only it uses) made unimportable in a fresh interpreter."""
    code = (
        f"import sys; sys.modules[{absent!r}] = None\n"
        "from proxy.cli import main\n"
        "sys.exit(main(['bench', '--help']))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and absent in lines[0] and lines[0].endswith("pip install -e .[bench]")


def test_serve_starts_and_answers_healthz(tmp_path):
    settings = tmp_path / "s.json"
    settings.write_bytes(orjson.dumps(settings_dict(tmp_path, "http://127.0.0.1:9/v1")))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--settings", str(settings), "--port", str(port)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:

        def healthz():
            assert proc.poll() is None, proc.stderr.read().decode()
            return http_request("GET", f"http://127.0.0.1:{port}/healthz", timeout=2)

        wait_until(healthz, "the proxy answering", 60, interval=0.2, ignore=(OSError,))
        r = healthz()
        assert r.status == 200 and r.json()["upstream"] == "http://127.0.0.1:9/v1"
        r = http_request(
            "POST", f"http://127.0.0.1:{port}/v1/chat/completions", {"model": "m", "messages": []}
        )
        assert r.status == 400 and r.json()["error"]["param"] == "messages"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, -signal.SIGTERM)


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("l0_gpu", "eviction", "mru"), ("l1_host", "eviction", "fifo"), ("l2_disk", "format", "npz")],
)
def test_a_tier_policy_or_format_not_implemented_is_refused_at_start(tmp_path, section, key, value):
    bad = tmp_path / "bad.json"
    raw = settings_dict(tmp_path)
    raw["attention_store"]["tiering"][section] = {key: value}
    bad.write_bytes(orjson.dumps(raw))
    r = run_cli("serve", "--settings", str(bad), cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1
    assert f"attention_store.tiering.{section}.{key}" in lines[0] and value in lines[0]


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("proxy", "max_concurrent_per_client", 4), ("local_runner", "hit_queue_wait_s", 30)],
)
def test_a_removed_setting_stops_start_up_saying_what_replaced_it(tmp_path, section, key, value):
    """Keys of an earlier release that do nothing now are refused, not silently ignored."""
    bad = tmp_path / "old.json"
    raw = settings_dict(tmp_path)
    raw.setdefault(section, {})[key] = value
    bad.write_bytes(orjson.dumps(raw))
    r = run_cli("serve", "--settings", str(bad), cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1
    assert f"{section}.{key} was removed" in lines[0] and "delete the key" in lines[0]


def test_validating_makes_nothing_and_start_up_makes_the_l2_folder(tmp_path):
    raw = settings_dict(tmp_path)
    settings = parse_settings(orjson.dumps(raw), tmp_path, env={})
    assert not (tmp_path / "kv").exists()  # validation has no side effects
    assert make_l2_folder(settings, tmp_path) == tmp_path / "kv"
    assert (tmp_path / "kv").is_dir() and (tmp_path / "kv").stat().st_mode & 0o777 == 0o700


def test_an_l2_folder_that_cannot_be_made_stops_start_up_with_one_line_naming_the_key(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = tmp_path / "bad.json"
    raw = settings_dict(tmp_path)
    raw["attention_store"]["tiering"]["l2_disk"]["path"] = str(blocker / "kv")
    bad.write_bytes(orjson.dumps(raw))
    r = run_cli("serve", "--settings", str(bad), "--port", "0", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "attention_store.tiering.l2_disk.path: cannot create" in lines[0] and str(blocker) in lines[0]


@pytest.mark.parametrize(
    ("given", "spin_count"),
    [({}, "20000"), ({"GOMP_SPINCOUNT": "300000"}, "300000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, None)],
    ids=["default", "operator-spin-count", "operator-wait-policy"],
)
def test_openmp_threads_spin_briefly_unless_the_operator_chose(monkeypatch, given, spin_count):
    from proxy.cli import wait_briefly_in_openmp

    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    wait_briefly_in_openmp()
    assert os.environ.get("GOMP_SPINCOUNT") == spin_count


def test_the_served_process_spins_briefly(tmp_path):
    """`attnstore serve` sets it before torch loads (GNU OpenMP reads it once, at load)."""
    code = (
        "import os, sys\n"
        "from proxy import cli\n"
        "cli.serving_app = lambda settings: print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules) or sys.exit(1)\n"
        "sys.argv = ['attnstore', 'serve', '--settings', sys.argv[1]]\n"
        "sys.exit(cli.main())\n"
    )
    settings = tmp_path / "settings.json"
    settings.write_bytes(orjson.dumps(settings_dict(tmp_path)))
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run(
        [sys.executable, "-c", code, str(settings)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    assert done.stdout.split() == ["20000", "False"], done.stdout + done.stderr


def test_startup_objects_leave_the_collectors_view():
    import gc

    from proxy.cli import freeze_startup_objects

    gc.unfreeze()
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
