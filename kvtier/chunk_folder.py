"""The L2 folder: where a chunk's file lives, temp file names that say who writes them, quarantine,
and the start-up scan.

File: `<root>/<key[:2]>/<key>.safetensors`. Files are created 0600 and folders 0700 (owner only): a
chunk holds its conversation's token ids in plain form, and file permissions are their only protection.
A temp file's name says which process wrote it (host hash, pid, a per-process token), so the start-up
scan removes the temp files a killed process of this host left (kill -9) at once; another host's (a
replica sharing the folder) only once they are older than STALE_TMP_SECONDS.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from .chunk_format import SUFFIX

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
QUARANTINE = "quarantine"
# A temp file of another host older than this is a crashed write (a chunk's write takes well under it).
STALE_TMP_SECONDS = 600.0
FILE_MODE = 0o600
DIR_MODE = 0o700


def host_tag() -> str:
    """This host, as temp file names name it (a hash: host names stay out of shared folders)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


# Who writes this process's temp files: `<host>-<pid>-<token>` (the token tells a restarted process that
# got the same pid, as in a container, from its predecessor).
_WRITER = f"{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def tmp_name(key: str) -> str:
    """A fresh temp file name for a chunk's write, naming this process as its writer."""
    return f".{key}.{uuid.uuid4().hex[:8]}.{_WRITER}{TMP_SUFFIX}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process (or not a pid): assume alive, the age rule decides
    return True


def is_stale_tmp(name: str, age_s: float) -> bool:
    """Whether a temp file is a dead write: this host's process that wrote it is gone (or it is this
    pid's predecessor), else it is older than STALE_TMP_SECONDS."""
    if age_s > STALE_TMP_SECONDS:
        return True
    writer = name[: -len(TMP_SUFFIX)].rsplit(".", 1)[-1].split("-")
    if len(writer) != 3 or writer[0] != host_tag() or not writer[1].isdigit():
        return False  # another host's, or an older naming: the age rule only
    pid = int(writer[1])
    if pid == os.getpid():
        return f"{writer[0]}-{writer[1]}-{writer[2]}" != _WRITER
    return not _pid_alive(pid)


def chunk_path(root: Path, key: str) -> Path:
    return root / key[:2] / f"{key}{SUFFIX}"


def make_dirs(path: Path) -> None:
    """Create a folder (and its parents) owner-only; an existing folder keeps its mode."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)


def quarantine(root: Path, path: Path, reason: str) -> None:
    """Move a bad file aside (never delete evidence, never serve it)."""
    dest_dir = root / QUARANTINE
    try:
        make_dirs(dest_dir)
        os.replace(path, dest_dir / f"{path.name}.{uuid.uuid4().hex[:8]}")
        log.warning("kvtier: quarantined %s: %s", path, reason)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("kvtier: could not quarantine %s (%s): %s", path, reason, e)


def scan(root: Path) -> Iterator[tuple[Path, float]]:
    """Chunk files under root (not the quarantine), oldest first by mtime; removes stale temp files."""
    found: list[tuple[Path, float]] = []
    now = time.time()
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root and QUARANTINE in dirnames:
            dirnames.remove(QUARANTINE)
        for name in filenames:
            p = Path(dirpath) / name
            try:
                mtime = p.stat().st_mtime
            except FileNotFoundError:
                continue
            if name.endswith(TMP_SUFFIX):
                if is_stale_tmp(name, now - mtime):  # a crashed write; a live one may be another replica's
                    with contextlib.suppress(OSError):
                        p.unlink()
                        log.info("kvtier: removed %s, a write a stopped process left", p)
            elif name.endswith(SUFFIX):
                found.append((p, mtime))
    found.sort(key=lambda pm: pm[1])
    yield from found
