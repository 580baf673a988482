"""The worker side's start: from vLLM's paged caches to a store, its socket and the WorkerSide.

vLLM registers one cache tensor per attention layer once it has allocated them; their shape, dtype and
attention backend give the store its layout, and the model folder, dtype, vLLM version and backend its
fingerprint. L0 (device memory in kvtier) stays empty: vLLM's own paged memory is that tier here.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from ..config import StoreConfig
from ..layout import KVLayout
from ..store import KVStore
from .options import ConnectorOptions, model_fingerprint
from .pages import PagedLayer, WriteKV, find_cpu_key_layout
from .plan import ordered_layers
from .service import StoreService
from .wire import StoreSocketServer
from .worker import WorkerSide

log = logging.getLogger("vllm.attnstore")  # under vLLM's logger: its handlers print it


def attention_backend(vllm_config: Any, layer_name: str) -> str:
    """The name of the attention backend vLLM chose for this layer (CPU_ATTN, FLASH_ATTN, ...)."""
    layer = vllm_config.compilation_config.static_forward_context[layer_name]
    return str(layer.attn_backend.get_name())


def cpu_kernel_writer(
    vllm_config: Any, layer_name: str, num_kv_heads: int, block_size: int, head_dim: int
) -> WriteKV:
    """vLLM's CPU kernel writing keys and values into a cache, with the ISA the layer runs with."""
    from vllm import _custom_ops as ops

    layer = vllm_config.compilation_config.static_forward_context[layer_name]
    isa = getattr(layer, "isa", None)
    if isa is None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(vllm_config.model_config.dtype, block_size, head_dim)

    def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        rows = cache.view(cache.shape[0], num_kv_heads, 2 * block_size, head_dim)
        key_cache, value_cache = rows.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    return write


def open_worker(
    vllm_config: Any, kv_caches: dict[str, torch.Tensor], options: ConnectorOptions
) -> tuple[WorkerSide, StoreSocketServer]:
    started = time.perf_counter()
    names = ordered_layers(kv_caches)
    model_config = vllm_config.model_config
    num_kv_heads = int(kv_caches[names[0]].shape[1])
    head_dim = int(model_config.get_head_size())
    backend = attention_backend(vllm_config, names[0])
    dtype = kv_caches[names[0]].dtype
    transposed = False
    if backend == "CPU_ATTN":
        block_size = int(kv_caches[names[0]].shape[2])
        write = cpu_kernel_writer(vllm_config, names[0], num_kv_heads, block_size, head_dim)
        transposed = find_cpu_key_layout(write, num_kv_heads, block_size, head_dim, dtype)
    layers = [
        PagedLayer(
            kv_caches[n],
            attention_backend(vllm_config, n),
            num_kv_heads,
            head_dim,
            keys_transposed=transposed,
        )
        for n in names
    ]
    layout = KVLayout(num_layers=len(names), num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    import vllm

    fingerprint = model_fingerprint(
        str(model_config.model),
        getattr(model_config, "revision", None),
        layout.dtype_name,
        f"vllm-{vllm.__version__}",
        backend,
    )
    device = kv_caches[names[0]].device
    store = KVStore(
        StoreConfig(
            l0_capacity_bytes=0,
            l1_capacity_bytes=options.l1_capacity_bytes,
            l2_capacity_bytes=options.l2_capacity_bytes,
            l2_path=Path(options.l2_path),
            chunk_tokens=options.chunk_tokens,
            device=device,
            async_save=options.async_save,
            placement_hint=options.placement_hint,
            drop_page_cache=options.drop_page_cache,
            l1_eviction=options.l1_eviction,
            l2_format=options.l2_format,
        ),
        layout,
        fingerprint,
    )
    service = StoreService(store, prefetch=options.prefetch)
    server = StoreSocketServer(options.socket_path, service.handlers())
    worker = WorkerSide(store, service, layers, names, layerwise=options.layerwise)
    log.info(
        "attnstore store ready in %.2f s: %s, %s layout, %d layers x %d KV heads x %d, %s; L1 %d MB, L2 %s "
        "(%d MB); chunks of %d tokens; socket %s",
        time.perf_counter() - started,
        backend + (" (keys stored transposed)" if transposed else ""),
        device,
        layout.num_layers,
        num_kv_heads,
        head_dim,
        layout.dtype_name,
        options.l1_capacity_bytes >> 20,
        options.l2_path,
        options.l2_capacity_bytes >> 20,
        options.chunk_tokens,
        options.socket_path,
    )
    return worker, server
