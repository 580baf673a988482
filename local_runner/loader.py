"""Model loading: an HF folder or a .gguf file, de-quantized once and cached as safetensors.

Loading the GGUF takes ~30 s on a small CPU (de-quantization and tokenizer conversion); the safetensors
copy loads in well under a second, so the conversion runs once per model file and dtype-independent
weights are kept under the cache folder.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import xxhash
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvtier import KVLayout

from .decoder import DecoderStack, fuse_projections
from .dense import can_pack as can_pack_linears
from .dense import pack_linears

log = logging.getLogger("attnstore.runner")

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_READY_MARK = "attnstore-converted.ok"


class ModelLoadError(RuntimeError):
    """A model source that cannot be found or loaded; the message names the source."""


class ThreadTokenizers:
    """One tokenizer per thread: a fast (Rust) tokenizer used from two threads at once fails with
    "Already borrowed", and the proxy renders prompts on executor threads while the runner's thread
    decodes answers. Copies are made on first use in each thread (a deep copy takes a few ms)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._origin = tokenizer
        self._lock = threading.Lock()
        self._local = threading.local()

    def get(self) -> PreTrainedTokenizerBase:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._lock:  # copying reads the original: never while another thread copies it
                tok = copy.deepcopy(self._origin)
            self._local.tokenizer = tok
        return tok


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
    # The eager step's dense path, set by the first runner that needs it (model_step.py): None while the
    # linear layers are as loaded, else "oneDNN packed" (weights reordered once, dense.py) or "plain" (why
    # not, after a colon); a compiled step needs them as loaded. `rows_invariant`: None until a batch_invariant runner makes the linear layers compute each
    # row alone (dense.make_rows_invariant), then whether that was verified.
    dense: str | None = None
    rows_invariant: bool | None = None
    tokenizers: ThreadTokenizers = field(init=False)

    def __post_init__(self) -> None:
        self.tokenizers = ThreadTokenizers(self.tokenizer)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but CUDA is not available")
    return dev


# CPU flags (as /proc/cpuinfo names them) of native bfloat16 arithmetic: AVX-512 BF16 or AMX.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags ('' where the file is missing: not Linux)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(dtype: str, device: torch.device, flags: frozenset[str] | None = None) -> torch.dtype:
    """`auto`: bfloat16 on CUDA and on CPUs with native bfloat16 arithmetic (2,048-token prefill 1.9 s
    against 3.5 s in float32 on such a CPU); float32 on other CPUs, where bfloat16 runs 4-7x slower."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if BF16_CPU_FLAGS & (cpu_flags() if flags is None else flags) else torch.float32


def configure_threads(threads: int = 0) -> int:
    """Use the cores this process may run on (not the machine's count, which containers misreport)."""
    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = threads
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def resolve_source(source: str) -> Path:
    """`pkg:NAME` is the .gguf file inside the installed package folder NAME (never imported)."""
    if source.startswith("pkg:"):
        spec = importlib.util.find_spec(source[4:])
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"model source {source!r}: package not installed (see README: make install)")
        ggufs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
        if not ggufs:
            raise ModelLoadError(f"model source {source!r}: no .gguf file in the package")
        return ggufs[0]
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model source {source!r}: no such file or folder")
    return path


def file_digest(path: Path) -> str:
    """Content hash of a model file or folder's weight files; part of every KV key, so KV of one
    model's weights is never served for another's."""
    h = xxhash.xxh3_128()
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.rglob("*") if p.suffix in {".safetensors", ".bin", ".gguf"})
    )
    for f in files:
        with f.open("rb") as fh:
            while block := fh.read(8 << 20):
                h.update(block)
    return h.hexdigest()


def _convert_gguf(gguf: Path, target: Path) -> None:
    log.info("first start: de-quantizing %s (about 30 s, done once; cached at %s)", gguf.name, target)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    log.info("  tokenizer converted (%.1f s); converting weights...", time.perf_counter() - started)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model although its weights are plain tensors by now.
    quantizer: Any = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _READY_MARK).write_text(gguf.name)
        try:
            os.replace(tmp, target)
        except OSError:  # another process (a second replica) finished first: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("  converted in %.1f s", time.perf_counter() - started)


def load_model(
    name: str,
    source: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    cache_dir: str | Path = "./var/models",
    threads: int = 0,
) -> LoadedModel:
    """Load (converting a GGUF once) and prepare a model, on a thread of its own (on_passing_thread)."""
    return on_passing_thread(
        _load_model, name, source, device=device, dtype=dtype, cache_dir=cache_dir, threads=threads
    )


def on_passing_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a thread that ends with it. Every thread that runs a parallel torch op keeps
    an OpenMP team for life, and once the process's teams hold more threads than there are cores, GNU
    OpenMP stops spinning between parallel regions (GOMP_SPINCOUNT's throttling): measured on this 2-core
    CPU, a decode step on the runner's thread took ~40 ms after a load on the main thread, ~24 ms after a
    load here. So torch work outside the runner's thread (a load, a benchmark's baseline) runs here."""
    with ThreadPoolExecutor(1, thread_name_prefix="attnstore-passing") as pool:
        return pool.submit(fn, *args, **kwargs).result()


def _load_model(
    name: str, source: str, *, device: str, dtype: str, cache_dir: str | Path, threads: int
) -> LoadedModel:
    started = time.perf_counter()
    configure_threads(threads)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_source(source)
    digest = file_digest(path)
    folder = path
    if path.is_file() and path.suffix == ".gguf":
        folder = Path(cache_dir) / f"{name}-{digest[:16]}"
        if not (folder / _READY_MARK).exists():
            _convert_gguf(path, folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dt)
        model = model.to(dev).eval()
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model {name!r} from {source!r}: {exc}") from exc
    fuse_llama_projections(model)
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
