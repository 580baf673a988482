"""What a start measured of this machine's kernels, kept in a JSON file so that the next start reads it
instead of measuring again (the rows per call of the CPU's products, the CUDA step's kernel configs).

A kept file is an optimisation, never a source of truth: one that is missing, unreadable or malformed
is measured again and rewritten, and one that cannot be written costs the next start a measurement.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("attnstore.runner")


def read_kept(path: Path, valid: Callable[[Any], bool]) -> Any | None:
    """The kept measurement, or None (missing, unreadable, or not `valid`: measured again)."""
    try:
        data = json.loads(path.read_text())
        if valid(data):
            return data
        log.warning("%s is malformed: measuring again", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        log.warning("%s unreadable (%s): measuring again", path, exc)
    return None


def write_kept(path: Path, data: Any) -> None:
    """Write atomically (a crash leaves the old file or none). The files of the same name before its last
    `-` (the same measurement under an older digest: another source, other settings) go: at worst a
    start under those settings measures again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, sort_keys=True))
        os.replace(temporary, path)
        stem = path.name.rsplit("-", 1)[0]
        for stale in path.parent.glob(f"{stem}-*.json"):
            if stale != path:
                stale.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not keep what was measured in %s: %s", path, exc)
