"""The connector's settings (vLLM's `kv_connector_extra_config`) and the model fingerprint its keys carry.

attnstore's proxy fills the extra config from settings.json; someone running vLLM alone with the
connector may set any of these keys or none. A key this does not know, or a value of the wrong type,
stops vLLM at start with one line naming it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import xxhash

GIB = 1 << 30


@dataclass(frozen=True)
class ConnectorOptions:
    l1_capacity_bytes: int = 8 * GIB  # host memory below vLLM's own KV memory (which is tier l0)
    l2_capacity_bytes: int = 64 * GIB
    l2_path: str = "./var/kv"
    chunk_tokens: int = 256  # a multiple of vLLM's block size
    socket_path: str = ""  # "" -> a path of this engine's own under the temp folder
    async_save: bool = True
    save: bool = True  # store finished requests' KV
    prefetch: bool = True  # bring waiting requests' disk chunks into host memory before they run
    lookahead: int = 1  # waiting requests (head of the queue) prefetched and protected from eviction
    scheduler_aware: bool = True  # the queue orders eviction (kvtier/schedule.py)
    layerwise: bool = True  # load layer i+1 while layer i computes (else: all layers before the forward)
    placement_hint: str = "ttft_priority"
    drop_page_cache: bool = False
    l1_eviction: str = "lru"
    l2_format: str = "safetensors"
    retention_max_share: float = 0.8  # the most of each tier retention holds keep ahead of the rest
    # A request waits at most this long for its prefetch, then loads from disk during its step.
    max_prefetch_wait_s: float = 5.0

    @staticmethod
    def from_extra(extra: dict[str, Any] | None, engine_id: str = "") -> ConnectorOptions:
        """Options from vLLM's kv_connector_extra_config; the socket defaults to one per engine id."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(ConnectorOptions)}
        values: dict[str, Any] = {}
        for name, value in extra.items():
            f = known.get(name)
            if f is None:
                raise ValueError(f"kv_connector_extra_config.{name}: not an AttnStoreConnector option")
            default = f.default
            if isinstance(default, bool):
                ok = isinstance(value, bool)
            elif isinstance(default, int):
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            elif isinstance(default, float):
                ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
            else:
                ok = isinstance(value, str)
            if not ok:
                raise ValueError(
                    f"kv_connector_extra_config.{name}: {value!r} is not a valid {type(default).__name__}"
                )
            values[name] = value
        options = ConnectorOptions(**values)
        if not options.socket_path:
            name = f"attnstore-vllm-{engine_id or os.getpid()}.sock"
            options = ConnectorOptions(**{**values, "socket_path": str(Path(tempfile.gettempdir()) / name)})
        return options


# Hashing every byte of a 100 GB model at each start would take minutes: each weight file contributes
# its name, its size and three 8 MB samples (start, middle, end), which tell apart any two checkpoints
# that differ anywhere but in the bytes between the samples of a file of the same size.
SAMPLE_BYTES = 8 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weights_digest(model: str) -> str:
    """A digest of a model folder's config and weight files, or of the name when it is not a folder (a
    hub id: its revision is in the fingerprint's other parts)."""
    folder = Path(model)
    h = xxhash.xxh3_128()
    if not folder.is_dir():
        h.update(f"name:{model}".encode())
        return h.hexdigest()
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")
    )
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.relative_to(folder)}:{size}".encode())
        with path.open("rb") as fh:
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                fh.seek(offset)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()


def model_fingerprint(model: str, revision: str | None, dtype: str, engine: str, backend: str) -> str:
    """Part of every key: KV is reused only by the same weights in the same dtype through the same engine
    and attention kernels (another engine's rounding would break exact reuse)."""
    text = f"{weights_digest(model)}:{revision or ''}:{dtype}:{engine}:{backend}"
    return xxhash.xxh3_64_hexdigest(text.encode())
