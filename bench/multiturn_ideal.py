"""The limit a KV-reuse hit can approach: prefilling only the new tokens on a cache already in memory.

Measured in the bench process with the very model the servers use, after each round of requests has
finished (so it never competes with them for the CPU). Per conversation we keep our own DynamicCache:
turn k+1's reused prefix is mostly turn k's prompt, so only the difference (the answer and the template
tokens around it) is prefilled untimed before the timed part; without that the bench would pay a full
prefill per turn just to set up the measurement.

For hits served from disk (L2), the limit also includes reading the reused KV bytes: `raw_read_seconds`
times plain reads of that many bytes from the L2 folder's files, in the same page-cache state the server
saw.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvtier.index import common_prefix_len


@dataclass
class _Held:
    cache: Any
    ids: list[int] = field(default_factory=list)


class IdealMeter:
    """Time to prefill ids[reused:] (plus the first token's argmax) on an in-memory cache of ids[:reused]."""

    def __init__(
        self,
        model: Any,
        device: torch.device | str = "cpu",
        prefill_chunk: int = 1024,
        repeats: int = 3,
        repeat_budget_s: float = 1.5,
    ) -> None:
        self.model = model
        self.repeats = repeats
        self.repeat_budget_s = repeat_budget_s
        self.device = torch.device(device)
        self.prefill_chunk = prefill_chunk
        self._held: dict[str, _Held] = {}

    def _forward(self, ids: list[int], cache: Any) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits

    @torch.inference_mode()
    def measure(self, key: str, ids: list[int], reused: int) -> float:
        """Seconds for the new tokens of this prompt; `key` names the conversation whose cache we keep."""
        reused = max(0, min(reused, len(ids) - 1))
        held = self._held.get(key)
        keep = min(common_prefix_len(held.ids, ids), reused) if held else 0
        if held is None or keep == 0:
            held = _Held(DynamicCache(config=self.model.config))
        elif len(held.ids) > keep:
            held.cache.crop(keep - len(held.ids))  # transformers 5 crops by a negative count
        for s in range(keep, reused, self.prefill_chunk):  # untimed: bring the cache to ids[:reused]
            self._forward(ids[s : min(s + self.prefill_chunk, reused)], held.cache)
        times: list[float] = []
        while True:
            started = time.perf_counter()
            logits = self._forward(ids[reused:], held.cache)
            int(logits[0, -1].argmax())
            times.append(time.perf_counter() - started)
            # Repeat short measurements (median of up to `repeats`): a single one on a shared CPU is noise.
            if len(times) >= self.repeats or sum(times) > self.repeat_budget_s:
                break
            held.cache.crop(reused - len(ids))
        held.ids = list(ids)
        self._held[key] = held
        return statistics.median(times)

    def forget(self, key: str) -> None:
        self._held.pop(key, None)


def raw_read_seconds(folder: Path, nbytes: int) -> float | None:
    """Time to read `nbytes` with plain file reads from the L2 folder's chunk files (newest first).

    When the folder holds fewer bytes, the time is scaled up linearly; None when it holds none.
    """
    if nbytes <= 0:
        return 0.0
    files = sorted(folder.rglob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
    buf = bytearray(1 << 22)
    view = memoryview(buf)
    total = 0
    started = time.perf_counter()
    for path in files:
        try:
            with open(path, "rb", buffering=0) as f:
                while total < nbytes:
                    n = f.readinto(view[: min(len(buf), nbytes - total)])
                    if not n:
                        break
                    total += n
        except OSError:
            continue
        if total >= nbytes:
            break
    seconds = time.perf_counter() - started
    if total == 0:
        return None
    return seconds * nbytes / total
