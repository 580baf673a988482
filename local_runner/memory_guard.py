"""Memory pressure, at the two moments the embedded engine may find the machine short: when a job is
admitted (below `min_free_memory_bytes` available, whatever the tier capacities say) and when a step
runs out of device memory (CUDA). With `evict_on_pressure` the stores give memory back and the job runs;
without, it fails with a 503.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvtier import KVStore, available_memory_bytes

from .config import EngineConfig
from .jobs import Job
from .kv_pages import PagePool

log = logging.getLogger("attnstore.runner")
MB = 1024 * 1024  # the log lines count in MB


class MemoryGuard:
    """Reads the engine's config and asks its pools and stores to give memory back; owns nothing that
    changes."""

    def __init__(self, config: EngineConfig, pools: Mapping[str, PagePool], stores: Mapping[str, KVStore]):
        self._config = config
        self._pools = pools
        self._stores = stores

    def refusal(self, job: Job) -> str | None:
        """Before a job's buffers are allocated: why it is refused (the machine is short of memory and
        nothing may be evicted), or None. With evict_on_pressure the stores drop memory copies of chunks
        that are safe on disk and the job runs."""
        min_free = self._config.min_free_memory_bytes
        if not min_free:
            return None
        available = available_memory_bytes()
        if available is None:
            return None
        pool = self._pools.get(job.request.model)
        # a job's KV takes host memory only where its pool is on the host (a CUDA pool is on the device,
        # allocated whole at start)
        on_host = pool is None or pool.device.type == "cpu"
        short = min_free + (job.kv_bytes if on_host else 0) - available
        if short <= 0:
            return None
        if self._config.evict_on_pressure:
            for pool in self._pools.values():
                pool.give_back()  # free KV pages' memory, first (what they held is gone already)
            freed = sum(store.shed_memory(short) for store in self._stores.values())
            log.warning(
                "memory pressure: %d MB available, %d MB to keep free; dropped %d MB of stored KV from memory",
                available // MB,
                min_free // MB,
                freed // MB,
            )
            return None
        return (
            f"the local runner is short of memory ({available // MB} MB available, "
            f"{min_free // MB} MB kept free); retry later"
        )

    def free_device_memory(self) -> bool:
        """A CUDA out-of-memory in a step: with evict_on_pressure, demote L0 (the device tier) and say
        whether anything moved (the step may run again); without, False (the job fails)."""
        if not self._config.evict_on_pressure:
            return False
        freed = sum(store.shed_device_memory() for store in self._stores.values())
        log.warning("device out of memory: moved %d MB of stored KV off the device", freed // MB)
        return freed > 0
