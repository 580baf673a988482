"""The worker side's start: from vLLM's paged caches to a store, its socket and the WorkerSide.

vLLM registers one cache tensor per attention layer once it has allocated them; their shape, dtype and
attention backend give the store its layout, each kind of layer (backend, shape, strides) its page map,
found through that backend's own write kernel (discover.py), and the model folder, dtype, vLLM version
and backend the store's fingerprint. L0 (device memory in kvtier) stays empty: vLLM's own paged memory is that tier here.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.config import StoreConfig
from kvtier.layout import KVLayout
from kvtier.store import KVStore

from .discover import LayoutError, WriteKV, find_page_map
from .options import ConnectorOptions, model_fingerprint
from .pages import PagedLayer, PageGeometry, PageMap
from .plan import ordered_layers
from .service import StoreService
from .wire import StoreSocketServer
from .worker import WorkerSide

log = logging.getLogger("vllm.attnstore")  # under vLLM's logger: its handlers print it


def attention_layer(vllm_config: Any, layer_name: str) -> Any:
    """vLLM's Attention module of this layer (its backend, its impl, on CPU its ISA)."""
    return vllm_config.compilation_config.static_forward_context[layer_name]


def attention_backend(vllm_config: Any, layer_name: str) -> str:
    """The name of the attention backend vLLM chose for this layer (CPU_ATTN, FLASH_ATTN, ...)."""
    return str(attention_layer(vllm_config, layer_name).attn_backend.get_name())


def kernel_writer(layer: Any) -> WriteKV:
    """The layer's own KV write (its impl's do_kv_cache_update: the op its forward uses, with the ISA and
    the scales vLLM set on the layer), writing into whatever cache it is given."""
    update = getattr(layer.impl, "do_kv_cache_update", None)
    if update is None:
        raise LayoutError(f"{type(layer.impl).__name__} has no do_kv_cache_update to find its KV layout with")

    def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        update(layer, key, value, cache, slots)

    return write


def kernel_name(layer: Any, backend: str, cache: torch.Tensor) -> str:
    """Backend, dtype and ISA (the CPU kernel's, or the CUDA device's), as a refusal names them."""
    dtype = str(cache.dtype).removeprefix("torch.")
    if cache.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(cache.device)
        return f"{backend} ({dtype}, sm_{major}{minor} {torch.cuda.get_device_name(cache.device)})"
    return f"{backend} ({dtype}, ISA {getattr(layer, 'isa', 'unknown')}{_cpu_flags()})"


def _cpu_flags() -> str:
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return ""
    known = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "asimd") if f in words]
    return f" on {' '.join(known)}" if known else ""


def paged_layers(
    vllm_config: Any, kv_caches: dict[str, torch.Tensor], names: list[str], geometry: PageGeometry
) -> tuple[list[PagedLayer], list[str]]:
    """Each layer's cache behind its page map, found once per kind of layer (backend, shape, strides,
    dtype) through that kind's first layer's kernel; and a line per kind for the log."""
    maps: dict[tuple[object, ...], PageMap] = {}
    notes: list[str] = []
    layers = []
    for name in names:
        cache, layer = kv_caches[name], attention_layer(vllm_config, name)
        backend = str(layer.attn_backend.get_name())
        kind = (backend, tuple(cache.shape), cache.stride(), cache.dtype, cache.device)
        if kind not in maps:
            what = kernel_name(layer, backend, cache)
            maps[kind] = find_page_map(kernel_writer(layer), cache, geometry, what)
            notes.append(f"{what}: {maps[kind].source}, K/V {PagedLayer(cache, maps[kind]).path}")
        layers.append(PagedLayer(cache, maps[kind]))
    return layers, notes


def open_worker(
    vllm_config: Any, kv_caches: dict[str, torch.Tensor], options: ConnectorOptions
) -> tuple[WorkerSide, StoreSocketServer]:
    started = time.perf_counter()
    names = ordered_layers(kv_caches)
    model_config = vllm_config.model_config
    first = kv_caches[names[0]]
    num_kv_heads = int(first.shape[1])
    head_dim = int(model_config.get_head_size())
    block_size = int(first.shape[2])
    if block_size != vllm_config.cache_config.block_size:
        raise ValueError(
            f"the KV cache has blocks of {block_size} tokens, vLLM's scheduler {vllm_config.cache_config.block_size}"
        )
    backend = attention_backend(vllm_config, names[0])
    dtype = first.dtype
    layers, notes = paged_layers(
        vllm_config, kv_caches, names, PageGeometry(num_kv_heads, head_dim, block_size)
    )
    layout = KVLayout(num_layers=len(names), num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    import vllm

    fingerprint = model_fingerprint(
        str(model_config.model),
        getattr(model_config, "revision", None),
        layout.dtype_name,
        f"vllm-{vllm.__version__}",
        backend,
    )
    device = first.device
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
            retention_max_share=options.retention_max_share,
        ),
        layout,
        fingerprint,
    )
    service = StoreService(store, prefetch=options.prefetch)
    server = StoreSocketServer(options.socket_path, service.handlers())
    worker = WorkerSide(store, service, layers, names, layerwise=options.layerwise)
    log.info(
        "attnstore store ready in %.2f s on %s: %s; %d layers x %d KV heads x %d, %s; L1 %d MB, L2 %s "
        "(%d MB); chunks of %d tokens; socket %s",
        time.perf_counter() - started,
        device,
        "; ".join(notes),
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
