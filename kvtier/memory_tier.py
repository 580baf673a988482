"""The memory tiers: L0 on the runner's device, L1 in host memory. Each holds its chunks as ChunkKV
buffers (its handles) on its own device.

A buffer admitted under the store lock may still be on another device: its bytes are valid (a ChunkKV
is never mutated), so a load may read it at once. `place` hands back the Copy that brings it over; the
store runs it with the lock released (`Copy.run`, which calls `copy_in`) and then `commit` swaps the
result in, if the tier still holds that very buffer under that key.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .chunk import ChunkKV, SideStreams
from .config import StoreConfig, resolve_device
from .eviction import EvictionPolicy, make_policy
from .layout import KVLayout
from .tier_interface import TierBackend
from .tier_names import Tier

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Copy:
    """A chunk buffer to bring onto its tier's device once the store lock is released."""

    tier: MemoryTier
    key: str
    source: ChunkKV
    result: ChunkKV | None = None

    def run(self) -> None:
        """Without the lock: the copy itself (none when the buffer is on that device already)."""
        try:
            self.result = self.tier.copy_in(self.source)
        except Exception:  # the tier keeps the valid source buffer; only its device is off
            log.exception("kvtier: moving chunk %s to %s failed", self.key, self.tier.name)


class MemoryTier(TierBackend[ChunkKV]):
    """A tier of tensor buffers on one device (`pin`: page-locked host buffers, for copies to CUDA)."""

    def __init__(
        self, name: Tier, capacity_bytes: int, policy: EvictionPolicy, device: torch.device, pin: bool = False
    ) -> None:
        super().__init__(name, capacity_bytes, policy)
        self.device = device
        self.pin = pin and device.type == "cpu"
        self._streams = SideStreams()  # the moves into this tier, one stream per CUDA device

    def place(self, key: str, nbytes: int, data: ChunkKV) -> Copy:
        """Admit `data` as it is and return the Copy that brings it onto this tier's device."""
        self.admit(key, nbytes, data)
        return Copy(self, key, data)

    def copy_in(self, data: ChunkKV) -> ChunkKV:
        """Without the store lock: `data` on this tier's device (itself when it is there already)."""
        return data.to(self.device, pin=self.pin, streams=self._streams)

    def commit(self, copy: Copy) -> None:
        """Swap in a finished copy, if this tier still holds the buffer it was made from."""
        if copy.result is not None and self._handles.get(copy.key) is copy.source:
            self._handles[copy.key] = copy.result

    def scan(self) -> Iterator[object]:
        return iter(())  # memory does not outlive the process


class DeviceTier(MemoryTier):
    """L0: ready tensors on the runner's device (on a CPU-only machine, host memory)."""

    @classmethod
    def from_config(cls, config: StoreConfig, layout: KVLayout, model_fingerprint: str) -> DeviceTier:
        return cls(
            "l0", config.l0_capacity_bytes, make_policy(config.l0_eviction), resolve_device(config.device)
        )


class HostTier(MemoryTier):
    """L1: host memory, pinned where the device is CUDA (pinned buffers only help copies to CUDA)."""

    @classmethod
    def from_config(cls, config: StoreConfig, layout: KVLayout, model_fingerprint: str) -> HostTier:
        pin = torch.device(config.device).type == "cuda"
        return cls("l1", config.l1_capacity_bytes, make_policy(config.l1_eviction), torch.device("cpu"), pin)
