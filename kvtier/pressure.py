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


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Host memory: MemAvailable in bytes, or None where the kernel does not say (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
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
