"""A transformers Cache over a JobKV, for models that take the per-job step (not the packed one).

transformers calls `update()` at each layer's attention; it writes the new tokens into the job's own
buffers and returns the layer's whole K/V. The job's length advances only after the forward (see
JobKV), so every layer sees the same past length, as transformers expects.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .job_kv import JobKV


class JobKVLayer(DynamicLayer):
    def __init__(self, kv: JobKV, index: int):
        super().__init__()
        self._kv = kv
        self._index = index

    def get_seq_length(self) -> int:
        return self._kv.length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self._kv.write(self._index, key_states, value_states)
        return self.keys, self.values

    def crop(self, max_length: int) -> None:
        self._kv.crop(max_length if max_length >= 0 else self._kv.length + max_length)


def job_cache(config: Any, kv: JobKV) -> DynamicCache:
    """A transformers cache whose layers read and write `kv`."""
    cache = DynamicCache(config=config)
    cache.layers = [JobKVLayer(kv, i) for i in range(kv.num_layers)]
    return cache
