"""Wait until a just-started server has warmed up: /healthz answers and no local model's `warm_up` is
"pending" any more (its kernels compiled, its CUDA graphs captured), so the first timed request does not
time the start. Gives up at once when the server's process is gone (a crash at load) rather than polling
until the limit, and prints its log's end then.

    python -m bench.gpu.ready --url http://127.0.0.1:8081 --pid 1234 --limit 200 --log OUT/serve.log

Exit status: 0 warmed up (or failed to: the server says why, and serves), 1 the server died, 2 too slow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def warm_up_states(url: str) -> list[str] | None:
    """Each local model's warm_up, or None while the server does not answer."""
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as resp:
            doc = json.load(resp)
    except (OSError, ValueError):
        return None
    return [str(model.get("warm_up", "done")) for model in (doc.get("local") or {}).values()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--limit", type=float, default=200)
    ap.add_argument("--log", type=Path)
    a = ap.parse_args(argv)
    started = time.monotonic()
    while time.monotonic() - started < a.limit:
        if not alive(a.pid):
            print(f"the server (pid {a.pid}) died after {time.monotonic() - started:.0f} s")
            if a.log is not None and a.log.exists():
                print("".join(a.log.read_text(errors="replace").splitlines(keepends=True)[-30:]))
            return 1
        states = warm_up_states(a.url.rstrip("/"))
        if states is not None and "pending" not in states:
            print(
                f"warmed up after {time.monotonic() - started:.0f} s: {', '.join(states) or 'no local model'}"
            )
            return 0
        time.sleep(1)
    print(f"the server did not warm up in {a.limit:.0f} s")
    return 2


if __name__ == "__main__":
    sys.exit(main())
