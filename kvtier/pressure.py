"""How much memory the machine, and the device, have left.

kvtier's capacities are budgets the operator sets; the machine can run short below them (other
processes, the runner's own job buffers). The runner asks these before it admits a job. This module
loads no torch until the device is asked about.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def available_memory_bytes(
    meminfo: Path = Path("/proc/meminfo"),
    self_cgroup: Path = Path("/proc/self/cgroup"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> int | None:
    """Host memory this process can still take, in bytes: the kernel's MemAvailable, or less where a
    memory cgroup (a container's limit) leaves less; None where neither says (not Linux). Inside a
    container MemAvailable is the host's: a process that trusted it would be killed at the limit instead
    of shedding its stored KV."""
    figures = [
        f for f in (_mem_available(meminfo), _cgroup_headroom(self_cgroup, cgroup_root)) if f is not None
    ]
    return min(figures) if figures else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# A cgroup v1 limit at or above this is "no limit" (the kernel writes PAGE_COUNTER_MAX pages' bytes).
_UNLIMITED = 1 << 60


def _cgroup_headroom(self_cgroup: Path, root: Path) -> int | None:
    """The least headroom of this process's memory cgroup and its parents that have a limit: the limit
    less the usage, the inactive file cache not counted as used (the kernel reclaims it before it kills,
    as the working set of container runtimes counts it). None where no limit is set or none is readable."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    v2 = next((line[3:] for line in lines if line.startswith("0::")), None)
    v1 = next((line.split(":", 2)[2] for line in lines if line.split(":")[1:2] == ["memory"]), None)
    if v1 is not None:  # a v1 hierarchy is mounted for memory: it is the one that limits
        folders = _cgroup_folders(root / "memory", v1)
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    elif v2 is not None:
        folders = _cgroup_folders(root, v2)
        files = ("memory.max", "memory.current", "inactive_file")
    else:
        return None
    headroom = [h for h in (_headroom(folder, *files) for folder in folders) if h is not None]
    return min(headroom) if headroom else None


def _cgroup_folders(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder and its parents up to the mount. Inside a container without a cgroup
    namespace the path is the host's and the mount is the container's own cgroup: the mount alone."""
    folder = mount / path.strip("/")
    if not folder.is_dir():
        return [mount]
    folders = [folder]
    while folder != mount and folder.parent != folder:
        folder = folder.parent
        folders.append(folder)
    return folders


def _headroom(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit_text = (folder / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _UNLIMITED:
            return None
        usage = int((folder / usage_file).read_text())
        inactive = 0
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
        return max(0, int(limit_text) - max(0, usage - inactive))
    except (OSError, ValueError):
        return None


def available_device_memory_bytes(device: str | torch.device) -> int | None:
    """What a CUDA device can still give this process, in bytes: the driver's free memory plus what
    torch's caching allocator holds reserved but unused (it hands that out first). None off CUDA (on a
    CPU device, L0 is host memory: see available_memory_bytes)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(dev)
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return int(free) + max(int(cached), 0)
