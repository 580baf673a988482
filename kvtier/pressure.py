"""How much memory the machine has left, as the kernel estimates it (MemAvailable).

kvtier's capacities are budgets the operator sets; the machine can run short below them (other
processes, the runner's own job buffers). The runner asks this before it admits a job.
"""

from __future__ import annotations

from pathlib import Path


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes, or None where the kernel does not say (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
