"""`attnstore bench` installed outside the checkout: the benchmarks import only what ships with the project
(bench/ with its servers and helpers in bench.support, proxy/, engine_api/, kvtier/, local_runner/),
never tests/.

The copy below is what `pip install attnstore[bench]` puts in site-packages; the interpreter runs from
another folder, so neither the checkout nor its tests/ is on the path (the editable install maps only the
packages, not tests/)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("bench", "proxy", "engine_api", "kvtier", "local_runner")
BENCH_MODULES = (
    "bench.agents",
    "bench.multiturn",
    "bench.peers",
    "bench.replica_forwarding",
    "bench.soak",
    "bench.streams_soak",
    "bench.proxy_overhead",
    "bench.support.fake_upstream",
)


def _python(code: str, site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_bench_imports_from_a_copy_of_the_package_without_tests(tmp_path: Path):
    site = tmp_path / "site"
    for name in PACKAGES:
        shutil.copytree(REPO / name, site / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import importlib, importlib.util, sys\n"
        f"for m in {BENCH_MODULES!r}:\n"
        "    mod = importlib.import_module(m)\n"
        f"    assert mod.__file__.startswith({str(site)!r}), (m, mod.__file__)\n"
        "assert importlib.util.find_spec('tests') is None, 'tests/ is reachable'\n"
        "from bench.multiturn import parser\n"
        "args = parser().parse_args(['--peer', 'http://127.0.0.1:1', '--sessions', '2'])\n"
        "print('ok', args.peer, args.sessions)\n"
    )
    done = _python(code, site, elsewhere)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok ['http://127.0.0.1:1'] 2" in done.stdout
