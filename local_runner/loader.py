"""Model loading for the embedded engine: the weights' folder (engine_api.model_source: an HF folder, or
a GGUF's safetensors copy made once), loaded on the device in the dtype asked for and prepared for the
packed step (fused projections), with what the KV store needs to key and shape its entries.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import xxhash
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engine_api.model_source import (
    ModelLoadError,
    auto_dtype,
    converted_folder,
    cpu_flags,
    file_digest,
    resolve_source,
)
from engine_api.tokenizers import ThreadTokenizers
from kvtier import KVLayout

from .decoder import DecoderStack, fuse_projections
from .dense import can_pack_linears, pack_linears

log = logging.getLogger("attnstore.runner")

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to run, with what the KV store needs to key and shape its entries."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    fingerprint: str
    layout: KVLayout
    max_context: int
    load_seconds: float
    eos_token_ids: frozenset[int]
    # The eager step's dense path, set by the first engine that needs it (model_step.py): None while the
    # linear layers are as loaded, else "oneDNN packed" (weights reordered once, dense.py) or "plain" (why
    # not, after a colon); a compiled step needs them as loaded. `rows_invariant`: None until a
    # batch_invariant engine makes the linear layers compute each row alone (dense.make_rows_invariant),
    # then whether that was verified.
    dense: str | None = None
    rows_invariant: bool | None = None
    tokenizers: ThreadTokenizers = field(init=False)

    def __post_init__(self) -> None:
        self.tokenizers = ThreadTokenizers(self.tokenizer)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(
            f"device {device!r} asked for, but this machine shows {torch.cuda.device_count()} GPUs"
        )
    return dev


def on_model_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The calling thread's current CUDA device set to `device` for the block (nothing on a CPU): Triton
    launches its kernels, and torch captures CUDA graphs and times events, on the thread's current device,
    whatever device the tensors are on."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def pick_dtype(dtype: str, device: torch.device, flags: frozenset[str] | None = None) -> torch.dtype:
    """The dtype named, or `auto`'s choice for this device (model_source.auto_dtype)."""
    if dtype == "auto":
        dtype = auto_dtype(device.type == "cuda", cpu_flags() if flags is None else flags)
    return _DTYPES[dtype]


def configure_threads(threads: int = 0) -> int:
    """Use the cores this process may run on (not the machine's count, which containers misreport)."""
    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = threads
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def load_model(
    name: str,
    source: str,
    *,
    cache_dir: str | Path,
    device: str = "auto",
    dtype: str = "auto",
    threads: int = 0,
) -> LoadedModel:
    """Load (converting a GGUF once, into `cache_dir`) and prepare a model, on a thread of its own
    (on_passing_thread). `auto` and 0 pick what this machine runs best (pick_device, pick_dtype,
    configure_threads)."""
    return on_passing_thread(
        _load_model, name, source, device=device, dtype=dtype, cache_dir=cache_dir, threads=threads
    )


def on_passing_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a thread that ends with it. Every thread that runs a parallel torch op keeps
    an OpenMP team for life, and once the process's teams hold more threads than there are cores, GNU
    OpenMP stops spinning between parallel regions (GOMP_SPINCOUNT's throttling), which slows every step
    of the engine's thread (docs/engine.md, "Batched steps": one OpenMP team). So torch work outside the
    engine's thread (a load, a benchmark's baseline) runs here."""
    with ThreadPoolExecutor(1, thread_name_prefix="attnstore-passing") as pool:
        return pool.submit(fn, *args, **kwargs).result()


def _load_model(
    name: str, source: str, *, device: str, dtype: str, cache_dir: str | Path, threads: int
) -> LoadedModel:
    started = time.perf_counter()
    configure_threads(threads)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    path = resolve_source(source)
    digest = file_digest(path)
    folder = path
    if path.is_file() and path.suffix == ".gguf":
        folder = converted_folder(name, path, digest, Path(cache_dir))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dt)
        model = model.to(dev).eval()
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model {name!r} from {source!r}: {exc}") from exc
    fuse_llama_projections(model)
    if dev.type == "cuda":  # the unfused weights' blocks, cached by torch, go back to the driver: its
        torch.cuda.empty_cache()  # free memory sizes the KV pool (kv_pages.cuda_pages)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layout = KVLayout(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        dtype=dt,
    )
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    seconds = time.perf_counter() - started
    log.info(
        "model %s loaded on %s as %s%s in %.2f s",
        name,
        dev,
        str(dt).removeprefix("torch."),
        " (dtype auto: native bfloat16 on this CPU)"
        if dtype == "auto" and dev.type == "cpu" and dt == torch.bfloat16
        else "",
        seconds,
    )
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        device=dev,
        dtype=dt,
        fingerprint=xxhash.xxh3_64_hexdigest(f"{digest}:{dt}".encode()),
        layout=layout,
        max_context=int(getattr(cfg, "max_position_embeddings", 2048)),
        load_seconds=seconds,
        eos_token_ids=frozenset(eos_ids),
    )


def fuse_llama_projections(model: Any) -> None:
    """q/k/v and gate/up as one matrix product each, for models decoder.py runs (at load: every step
    kind, eager or compiled, gains from it)."""
    if DecoderStack.unfit(model) is None:
        log.info("fused q/k/v and gate/up projections in %d layers", fuse_projections(model))


def pack_dense(model: Any, dtype: torch.dtype, device: torch.device, exact: bool = False) -> str:
    """Pack the linear weights for oneDNN where this machine can (the eager step's dense path; a compiled
    step packs its own), or for exact_linear.cpp's kernel where `exact` (batch_invariant, the kernel
    built and runnable here); returns the dense path's name for /healthz and the log."""
    reason = can_pack_linears(dtype, device)
    if reason is not None:
        dense = f"plain: {reason}"
    else:
        packed, exact_count = pack_linears(model, exact)
        dense = f"oneDNN packed ({packed} linear layers)"
        if exact_count:
            dense = f"exact AMX kernel ({exact_count} linear layers)" + (f", {dense}" if packed else "")
    log.info("dense path: %s", dense)
    return dense
