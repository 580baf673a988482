"""Issue 13, the store's part: a full disk that frees up, several bad chunks in one match, temp files
a killed process left, and owner-only L2 files."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading

import pytest

from kvtier import KVLoadError
from kvtier.chunk_folder import TMP_SUFFIX, chunk_path, host_tag
from tests.support.waiting import wait_until
from tests.test_kvtier import CB, FullDiskTier, files, kv, make, own, quarantined, toks


def test_saving_resumes_after_the_disk_is_freed(tmp_path):
    full = threading.Event()
    full.set()
    disk = {"l2": own(FullDiskTier, full=full)}
    s = make(tmp_path, async_save=True, disk_full_backoff_s=0.05, tiers=disk)
    try:
        s.put("t", toks(8), kv(8))
        s.flush()
        assert s.stats().save_errors >= 1 and files(tmp_path) == []
        full.clear()  # space freed
        wait_until(lambda: s.stats().saving_enabled, "saving resumed after its back-off", timeout=10)
        s.put("t", toks(8, 100), kv(8, seed=1))
        s.flush()
        assert len(files(tmp_path)) == 2
        assert s.stats().tiers["l2"].entries == 2
    finally:
        s.close()


def _flip(path, where: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[where] ^= 0x01  # the header stays valid: only a layer checksum can tell
    path.write_bytes(bytes(data))


def test_every_bad_chunk_of_a_match_is_quarantined_at_once_and_the_valid_prefix_stays(tmp_path):
    writer = make(tmp_path)
    writer.put("t", toks(20), kv(20))  # five chunks of 4 tokens
    keys = [c.key for c in writer.lookup("t", toks(20)).chunks]
    writer.close()
    assert len(keys) == 5
    for i in (2, 4):  # chunks 0 and 1 are good, 2 and 4 bad, 3 good but after a bad one
        _flip(chunk_path(tmp_path / "l2", keys[i]))
    s = make(tmp_path, 0, 0, 100 * CB)  # disk only: every chunk is read from its file
    try:
        m = s.lookup("t", toks(20))
        assert m.tokens == 20
        with pytest.raises(KVLoadError):
            s.load(m).wait()
        assert len(quarantined(tmp_path)) == 2  # both bad files at once, not one per turn
        again = s.lookup("t", toks(20))
        assert again.tokens == 8  # the two valid chunks before the first bad one are still reused
        s.load(again).wait()
    finally:
        s.close()


def test_temp_file_of_a_killed_process_is_removed_at_start(tmp_path):
    s = make(tmp_path)
    s.put("t", toks(4), kv(4))
    s.close()
    folder = files(tmp_path)[0].parent
    # A process of this host that died (kill -9) mid-write: its pid is gone, the file is fresh.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(dead.stdout)
    host = host_tag()
    left = folder / f".{'ab' * 8}.1234abcd.{host}-{dead_pid}-deadbeef{TMP_SUFFIX}"
    left.write_bytes(b"partial")
    # Our own pid but another token: a restarted container whose process got the same pid.
    same_pid = folder / f".{'cd' * 8}.1234abcd.{host}-{os.getpid()}-0badf00d{TMP_SUFFIX}"
    same_pid.write_bytes(b"partial")
    # Another host's write in progress (a replica sharing the folder): left alone while fresh.
    foreign = folder / f".{'ef' * 8}.1234abcd.00000000-1-feedface{TMP_SUFFIX}"
    foreign.write_bytes(b"partial")
    s2 = make(tmp_path)
    try:
        assert not left.exists() and not same_pid.exists()
        assert foreign.exists()
        assert s2.lookup("t", toks(4)).tokens == 4
    finally:
        s2.close()


def test_l2_files_and_folders_are_owner_only(tmp_path):
    old = os.umask(0o022)  # the usual umask: without an explicit mode, files would be 0644
    try:
        s = make(tmp_path)
        s.put("t", toks(8), kv(8))
        s.close()
    finally:
        os.umask(old)
    written = files(tmp_path)
    assert len(written) == 2
    for f in written:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        assert stat.S_IMODE(f.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "l2").stat().st_mode) == 0o700


# ---- host memory inside a container: the cgroup's limit, not the host's MemAvailable ----------------


def _cgroup_files(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def _memory(tmp_path, cgroup_lines, **folders):
    """available_memory_bytes over a /proc and /sys/fs/cgroup written here: MemAvailable 16 GiB."""
    from kvtier import available_memory_bytes

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "meminfo").write_text("MemTotal: 33554432 kB\nMemAvailable: 16777216 kB\n")
    (tmp_path / "self_cgroup").write_text(cgroup_lines)
    for path, contents in folders.items():
        _cgroup_files(tmp_path / "cg" / path, contents)
    (tmp_path / "cg").mkdir(exist_ok=True)
    return available_memory_bytes(tmp_path / "meminfo", tmp_path / "self_cgroup", tmp_path / "cg")


GiB = 1 << 30


def test_a_v2_limit_below_memavailable_is_what_is_available(tmp_path):
    # 4 GiB limit, 3 GiB charged of which 1 GiB inactive page cache (reclaimed before a kill): 2 GiB left
    got = _memory(
        tmp_path,
        "0::/app\n",
        app={
            "memory.max": f"{4 * GiB}\n",
            "memory.current": f"{3 * GiB}\n",
            "memory.stat": f"anon 1\ninactive_file {GiB}\n",
        },
    )
    assert got == 2 * GiB


def test_a_parents_limit_counts_and_no_limit_leaves_memavailable(tmp_path):
    limited = _memory(
        tmp_path / "a",
        "0::/pod/app\n",
        **{
            "pod": {"memory.max": f"{3 * GiB}\n", "memory.current": f"{2 * GiB}\n", "memory.stat": ""},
            "pod/app": {"memory.max": "max\n", "memory.current": f"{2 * GiB}\n", "memory.stat": ""},
        },
    )
    assert limited == GiB
    unlimited = _memory(tmp_path / "b", "0::/app\n", app={"memory.max": "max\n", "memory.current": "5\n"})
    assert unlimited == 16 * GiB


def test_a_v1_limit_and_a_containers_own_mount(tmp_path):
    # v1 inside a container: /proc/self/cgroup names the host's path, the mount is the container's cgroup
    got = _memory(
        tmp_path / "a",
        "4:memory:/docker/abc\n0::/\n",
        memory={
            "memory.limit_in_bytes": f"{8 * GiB}\n",
            "memory.usage_in_bytes": f"{5 * GiB}\n",
            "memory.stat": f"cache 9\ntotal_inactive_file {GiB}\n",
        },
    )
    assert got == 4 * GiB
    # the kernel's "no limit" (PAGE_COUNTER_MAX pages) and unreadable files: MemAvailable alone
    assert (
        _memory(
            tmp_path / "b",
            "4:memory:/\n",
            memory={"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "1\n"},
        )
        == 16 * GiB
    )
    assert _memory(tmp_path / "c", "4:memory:/\n", memory={"memory.limit_in_bytes": "garbled\n"}) == 16 * GiB
