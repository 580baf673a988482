"""How one loaded model computes the embedded engine's steps: the step's kind (all jobs packed into one
forward, or one forward per job), its forward (decoder.py's loop, compiled or eager, or transformers'),
its dense path, its KV pool, and batch invariance. The engine owns one per model.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import exact_kernel, kernel_choice, triton_attention, triton_ops
from .compiled import CompiledStack, first_line
from .cuda_graphs import DecodeGraphs
from .cuda_stack import CudaStack, layer_products
from .decoder import DecoderStack
from .dense import is_rule, make_rows_invariant
from .job_kv import JobKV
from .kept import read_kept, write_kept
from .kernel_choice import KernelChoice
from .kv_pages import PagePool, cuda_pages
from .loader import LoadedModel, on_passing_thread, pack_dense
from .packed_attention import can_pack, use_packed_attention
from .reuse_policy import MIN_MEASURED_TOKENS, PrefillRate
from .rope_config import varying_rope
from .sampling import RowLogits
from .step import Work, run_packed, run_per_job

log = logging.getLogger("attnstore.runner")


@dataclass
class ModelStep:
    lm: LoadedModel
    packed: bool  # every running job in one forward per step (else one forward per job)
    stack: DecoderStack | None  # the packed step's forward when the model has Llama's layers
    pool: PagePool
    batch_invariant: bool
    compile_wanted: bool  # compile the packed step after warm-up (falls back to eager, saying why)
    compiled: CompiledStack | None = None
    compile_status: str = "off"
    cuda: CudaStack | None = None  # the packed step's forward on CUDA (cuda_stack.py)
    graphs: DecodeGraphs | None = None  # its decode steps as CUDA graphs, once captured
    graphs_status: str = "off"
    # "pending" until the worker has run warm_up: "done in N s", or "failed: why" (the engine says).
    # /healthz shows it, so a client that times requests (a benchmark, a balancer) can wait for it.
    warm_up_status: str = "pending"
    context: int = 0  # the most tokens a job holds (the graphs' page tables are this wide)
    max_running: int = 1
    prefill_rate: PrefillRate = field(default_factory=PrefillRate)  # measured on the prompt steps
    kernels: KernelChoice | None = None  # the CUDA step's kernel configs and how they were chosen

    @classmethod
    def prepare(
        cls,
        lm: LoadedModel,
        *,
        slots: int,
        context: int,
        batch: bool,
        batch_invariant: bool | None,
        compile: bool,
        max_rows: int,
        page_tokens: int = 256,
        device_reserve_bytes: int = 0,
    ) -> ModelStep:
        """`batch=False`: one forward per job for this model (a benchmark's same-run baseline). `compile`:
        where the model allows, `warm_up` starts compiling the packed step on a thread of its own.
        `max_rows`: the most tokens one step feeds (batch_invariant measures the kernels up to it)."""
        packed = batch and _triton_runs(lm) and _takes_packed_step(lm)
        reserve = device_reserve_bytes + _activation_bytes(lm, max_rows, context)
        if lm.device.type == "cuda" and packed:
            why_not_cuda = _why_not_cuda_stack(lm)
            if why_not_cuda is None:
                # before the pool: the measurement's buffers are given back, the pool takes what is free
                kernels, invariant = _kernel_choice(
                    lm, batch_invariant, max_rows, slots, page_tokens, context
                )
                pool = _make_pool(lm, slots, context, page_tokens, reserve)
                cuda = CudaStack(
                    lm.model,
                    invariant=invariant,
                    max_positions=context,
                    attention=kernels.attention,
                    linear=kernels.linear,
                )
                step = cls(lm, packed, None, pool, invariant, False, cuda=cuda, kernels=kernels)
                step.context, step.max_running = context, slots
                step.compile_status = "off (CUDA graphs replay the decode steps)"
                return step
            log.info("model %s: the CUDA step runs transformers' forward: %s", lm.name, why_not_cuda)
        if batch_invariant is None:
            batch_invariant = invariant_by_default(lm.device)
        pool = _make_pool(lm, slots, context, page_tokens, reserve)
        has_stack = packed and DecoderStack.unfit(lm.model) is None
        why_not = _why_not_compiled(lm, has_stack, batch_invariant) if compile else "off"
        exact_cpu = batch_invariant and packed and lm.device.type == "cpu"
        if packed and lm.device.type == "cpu":
            exact_kernel.ensure_built()  # once per process (and once per machine: kept on disk)
        if why_not is not None:  # the eager dense path (before the stack: it calls the layers it finds)
            _pack(lm, exact=exact_cpu and exact_kernel.amx_linear_ready())
            if batch_invariant:
                _make_rows_invariant(lm, max_rows)
        stack = _decoder_stack(lm) if packed else None
        if (
            stack is not None
            and batch_invariant
            and lm.device.type == "cpu"
            and exact_kernel.ready(stack.head_dim)
        ):
            stack.use_fused_elementwise()
        step = cls(lm, packed, stack, pool, batch_invariant, why_not is None)
        if why_not is None:
            step.compile_status = "compiling (the eager step serves meanwhile)"
        elif why_not != "off":
            log.info("model %s: the packed step runs eagerly: %s", lm.name, why_not)
            step.compile_status = f"eager ({why_not})"
        return step

    def warm_up(self, run: Callable[[list[Work]], object]) -> None:
        """On the engine's thread, before the first job: run each kind of step once through `run` (the
        step as the engine calls it), so that no client pays for lazy initialisation (kernels, allocator
        arenas: a first prefill is much slower); then, if wanted, compile the packed step on a
        thread of its own. Jobs run on the eager step meanwhile (its linear layers as loaded: slower,
        never waiting) and on the compiled one from the step after it is ready."""
        started = time.perf_counter()
        _each_step_kind(self.lm, run)
        if self.cuda is not None:
            self._capture_graphs()
            if self.context > triton_attention.PARTITION:  # a row may pass a partition: its merge too
                triton_attention.warm_long_rows(*self.pool.layer(0), self.cuda.heads, self.cuda.attention)
        self.warm_up_status = f"done in {time.perf_counter() - started:.1f} s"
        if self.compile_wanted and self.stack is not None:
            self.compile_wanted = False
            threading.Thread(
                target=self._compile, args=(self.stack,), name="attnstore-compile", daemon=True
            ).start()

    def _compile(self, stack: DecoderStack) -> None:
        """Compile and warm up the packed step on standalone KV (never a running job's). On a thread
        that ends with it: every thread that runs a parallel torch op keeps an OpenMP team for life
        (loader.on_passing_thread), so the runner's steps are slower only while this runs."""
        started = time.perf_counter()
        with contextlib.suppress(OSError):  # the lowest CPU priority for this thread and its compilers
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            compiled = CompiledStack(self.lm.model, stack)
            _each_step_kind(self.lm, lambda work: run_packed(self.lm, work, stack=compiled))
        except Exception as exc:  # any compiler failure: the eager forward computes the same thing
            reason = first_line(exc)
            log.warning(
                "model %s: the packed step runs eagerly: torch.compile failed: %s", self.lm.name, reason
            )
            _pack(self.lm, exact=False)  # not batch_invariant: compiled steps are not
            self.stack = _decoder_stack(self.lm)  # the packed layers; the worker takes it at its next step
            self.compile_status = f"eager (compile failed: {reason})"
        else:
            self.compiled = compiled  # the worker's next step runs it
            self.compile_status = f"compiled in {time.perf_counter() - started:.1f} s"
            log.info("model %s: the packed step is %s", self.lm.name, self.compile_status)

    def _capture_graphs(self) -> None:
        """The decode steps' CUDA graphs, one per batch-size bucket up to max_running (on the worker's
        thread, before the first job); a failure leaves the eager step serving, said once."""
        assert self.cuda is not None
        started = time.perf_counter()
        try:
            graphs = DecodeGraphs(self.cuda, self.pool, self.max_running, self.context)
            graphs.capture()
        except Exception as exc:
            reason = first_line(exc)
            log.warning(
                "model %s: decode steps run eagerly: CUDA graph capture failed: %s", self.lm.name, reason
            )
            self.graphs_status = f"eager (capture failed: {reason})"
            return
        self.graphs = graphs
        self.graphs_status = (
            f"{len(graphs.buckets)} batch sizes up to {graphs.buckets[-1]}, "
            f"{len(graphs.partition_classes)} partition counts up to {graphs.partition_classes[-1]}, "
            f"captured in {time.perf_counter() - started:.1f} s"
        )
        log.info("model %s: decode steps replay CUDA graphs: %s", self.lm.name, self.graphs_status)

    @property
    def compiling(self) -> bool:
        return self.compile_status.startswith("compiling")

    def forward(self, work: list[Work]) -> list[RowLogits | None]:
        if self.graphs is not None and self.graphs.fits(work):
            return self.graphs.run(work)
        prompt = sum(len(w.tokens) for w in work if len(w.tokens) > 1)
        if prompt < MIN_MEASURED_TOKENS:
            return self._forward(work)
        started = time.perf_counter()
        result = self._forward(work)
        if self.lm.device.type == "cuda":
            # a long prompt step: its time is the device's, this stream's only (a device-wide
            # synchronize would also wait for the store's restores and saves on their own streams)
            torch.cuda.current_stream(self.lm.device).synchronize()
        self.prefill_rate.observe(prompt, time.perf_counter() - started)
        return result

    def _forward(self, work: list[Work]) -> list[RowLogits | None]:
        if self.cuda is not None:
            return run_packed(
                self.lm,
                work,
                batch_invariant=self.batch_invariant,
                stack=self.cuda,
                attention=self.cuda.attention,
            )
        if self.packed:
            stack = self.compiled or self.stack
            return run_packed(self.lm, work, batch_invariant=self.batch_invariant, stack=stack)
        return run_per_job(self.lm, work)

    def describe(self) -> dict[str, object]:
        """Where and how the model runs (for /healthz)."""
        return {
            "device": str(self.lm.device),
            "dtype": str(self.lm.dtype).removeprefix("torch."),
            "batched": self.packed,
            "batch_invariant": self.batch_invariant,
            "attention": _attention_kind(self),
            "dense": _dense_kind(self),
            "compiled": self.compile_status,
            "cuda_graphs": self.graphs_status,
            **({"kernels": self.kernels.describe()} if self.kernels is not None else {}),
            "warm_up": self.warm_up_status,
            "kv_pages": self.pool.pages,
            "page_tokens": self.pool.page_tokens,
            "kv_pool_tokens": self.pool.capacity,
        }


def invariant_by_default(device: torch.device) -> bool:
    """batch_invariant's "auto" where no measurement decides it: on a CPU (the exact kernels cost little
    there); off on CUDA where the Triton step does not serve the model (transformers' forward on cuBLAS).
    Where it serves, the invariant products' cost measured on the device decides (_kernel_choice)."""
    return device.type != "cuda"


def _attention_kind(step: ModelStep) -> str:
    """Which attention the step runs (packed_attention.attend's choice)."""
    if not step.packed:
        return "transformers"
    head_dim = step.lm.layout.head_dim
    if step.lm.device.type == "cpu":
        if exact_kernel.ready(head_dim) or step.batch_invariant:
            return exact_kernel.describe(head_dim)
        return "sdpa per job (no kernel: rounding depends on the batch)"
    group = step.lm.model.config.num_attention_heads // step.lm.layout.num_kv_heads
    if triton_attention.ready(head_dim, group):
        return "paged (triton: a row's bits never depend on the batch)"
    return "sdpa per job (no Triton)" if not step.batch_invariant else "exact (padded calls)"


def _dense_kind(step: ModelStep) -> str:
    if step.cuda is not None:
        if step.cuda.invariant:
            return "triton (one tile shape for every row count: batch-invariant)"
        return "cuBLAS (its kernel, and rounding, depend on the row count)"
    return step.lm.dense or "as loaded"


def _why_not_cuda_stack(lm: LoadedModel) -> str | None:
    """None when the CUDA forward serves this model, else why not (then transformers' forward runs the
    packed step)."""
    if not triton_attention.available():
        return "Triton is not installed"
    if DecoderStack.unfit(lm.model) is not None:
        return f"not a Llama-family decoder: {DecoderStack.unfit(lm.model)}"
    return CudaStack.unfit(lm.model)


def _kernel_choice(
    lm: LoadedModel, batch_invariant: bool | None, max_rows: int, slots: int, page_tokens: int, context: int
) -> tuple[KernelChoice, bool]:
    """The CUDA step's kernel configs for this model, measured on this device at its first start and kept
    (kernel_choice.py), and whether the step is batch-invariant (for "auto": where the invariant products
    measured within kernel_choice.INVARIANT_COST_BOUND of cuBLAS)."""
    heads = int(lm.model.config.num_attention_heads)
    shape = kernel_choice.ModelShape(
        heads=heads,
        kv_heads=lm.layout.num_kv_heads,
        head_dim=lm.layout.head_dim,
        page_tokens=page_tokens,
        dtype=lm.dtype,
        prompt_rows=min(max_rows, kernel_choice.PROMPT_ROWS, context),
        decode_jobs=min(slots, kernel_choice.DECODE_JOBS),
        context=context,
    )
    folder = exact_kernel.kernels_folder() / kernel_choice.device_key(lm.device)
    choice, invariant = kernel_choice.choose(
        shape, lm.device, invariant=batch_invariant, weights=layer_products(lm.model), folder=folder
    )
    log.info("model %s: kernels %s", lm.name, choice.describe())
    return choice, invariant


def _why_not_compiled(lm: LoadedModel, has_stack: bool, batch_invariant: bool) -> str | None:
    """None when this model's packed step can be compiled, else why not (then it runs eagerly)."""
    if not has_stack:
        return "only decoder.py's forward is compiled (Llama-family models, batched steps)"
    if batch_invariant:
        return "batch_invariant runs eagerly (the compiled step's products round by the row count)"
    if lm.dense is not None:
        return "another runner already packed this model's linear layers for an eager step"
    return None


def _each_step_kind(lm: LoadedModel, run: Callable[[list[Work]], object]) -> None:
    """One step of each kind: a prompt chunk, a lone decoding token, decoding beside a prompt chunk,
    several decoding jobs."""
    token = lm.tokenizer.eos_token_id or 0
    a, b = JobKV.standalone(lm.layout, lm.device, 32), JobKV.standalone(lm.layout, lm.device, 32)
    try:
        run([Work(a, [token] * 8, want_logits=True)])
        run([Work(a, [token], want_logits=True)])
        run([Work(a, [token], want_logits=True), Work(b, [token] * 5, want_logits=False)])
        run([Work(a, [token], want_logits=True), Work(b, [token], want_logits=True)])
    finally:
        a.pool.close()
        b.pool.close()


def _pack(lm: LoadedModel, exact: bool) -> None:
    """The eager dense path: linear weights packed once per model (idempotent: the first runner's choice
    stays), for exact_linear.cpp's kernel where `exact`, else for oneDNN, on a thread that ends with it
    (loader.on_passing_thread says why)."""
    if lm.dense is None:
        lm.dense = on_passing_thread(pack_dense, lm.model, lm.dtype, lm.device, exact)


def _triton_runs(lm: LoadedModel) -> bool:
    """On CUDA with Triton installed, whether a first kernel compiles and runs: the packed step's
    attention and the CUDA step are Triton's there, and Triton compiles its launcher with the machine's C
    compiler against Python's headers, which a slim image may lack. Where it cannot, the model runs one
    job per forward on transformers' own attention (no Triton), said once."""
    if lm.device.type != "cuda" or not triton_ops.available():
        return True
    why = triton_ops.launch_failure(lm.device, lm.dtype)
    if why is not None:
        log.warning("model %s: one forward per job on transformers' attention: %s", lm.name, why)
    return why is None


def _takes_packed_step(lm: LoadedModel) -> bool:
    """Llama-style decoders take the packed (batched) step; any other model runs one job per forward."""
    reason = can_pack(lm.model.config) or varying_rope(lm.model)
    if reason is None:
        use_packed_attention(lm.model)
        return True
    log.info("model %s: one forward per job (no batched steps): %s", lm.name, reason)
    return False


def _decoder_stack(lm: LoadedModel) -> DecoderStack | None:
    reason = DecoderStack.unfit(lm.model)
    if reason is None:
        return DecoderStack(lm.model)
    log.info("model %s: the packed step runs the transformers forward: %s", lm.name, reason)
    return None


def _make_rows_invariant(lm: LoadedModel, max_rows: int) -> None:
    """batch_invariant: a row's product must not depend on the rows beside it. The linear layers are
    wrapped once per loaded model (dense.make_rows_invariant: measured per shape; at least 2 rows per call,
    at most 32, or padded tiles, where the kernel depends on the row count); a failed check is said, not
    hidden. What was measured is kept per machine (rows_file), so a restart reads it instead of measuring
    again (docs/engine.md, "Batch invariance"). It multiplies on a thread that ends with it
    (loader.on_passing_thread says why: on the engine's thread it would slow every later step)."""
    if lm.rows_invariant is None:
        path = rows_file(lm.dtype, max_rows) if lm.device.type == "cpu" else None  # a GPU: every start
        measured = (read_kept(path, _valid_rows) or {}) if path is not None else {}
        before = dict(measured)
        lm.rows_invariant = on_passing_thread(
            make_rows_invariant, lm.model, lm.dtype, lm.device, max_rows, measured=measured
        )
        if not lm.rows_invariant:
            log.warning("model %s: batch_invariant: a linear layer still depends on the batch here", lm.name)
        elif path is not None and measured != before:
            write_kept(path, measured)


# Environment variables that change which kernels torch's products run (and so how they round).
_KERNEL_ENVIRONMENT = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "ATEN_CPU_CAPABILITY",
)


def rows_file(dtype: torch.dtype, max_rows: int) -> Path:
    """Where the rows per call measured for this dtype are kept: under the machine's folder (its CPU
    flags and torch's version in the name: what picks the kernels), with the thread count (oneDNN's
    blocking follows it), the rows measured up to, and a digest of dense.py (how it measures) and of the
    settings that cap the ISA oneDNN, MKL and ATen use."""
    digest = hashlib.sha256(Path(make_rows_invariant.__code__.co_filename).read_bytes())
    for variable in _KERNEL_ENVIRONMENT:
        digest.update(f"|{variable}={os.environ.get(variable, '')}".encode())
    source = digest.hexdigest()[:8]
    name = f"rows-{str(dtype).removeprefix('torch.')}-{torch.get_num_threads()}t-{max_rows}-{source}.json"
    return exact_kernel.machine_folder() / name


def _valid_rows(data: object) -> bool:
    return isinstance(data, dict) and all(isinstance(k, str) and is_rule(v) for k, v in data.items())


def _make_pool(lm: LoadedModel, jobs: int, context: int, page_tokens: int, reserve_bytes: int) -> PagePool:
    """The model's KV pool: pages enough for `jobs` jobs of `context` tokens each. On the CPU its memory
    is taken only as jobs write it; on CUDA the pool is cut to what the device memory free now gives,
    once `reserve_bytes` (the store's L0, the step's activations) are set aside, and a job's context is
    then bounded by the pool (the scheduler preempts a job when the pool runs out)."""
    per_job = -(-context // page_tokens)
    pages = jobs * per_job
    if lm.device.type == "cuda":
        fit = cuda_pages(lm.layout, lm.device, page_tokens, pages, reserve_bytes, share=0.9)
        if fit < pages:
            log.info(
                "model %s: a KV pool of %d pages of %d tokens (%.1f GB) fits the device",
                lm.name,
                fit,
                page_tokens,
                fit * page_tokens * lm.layout.bytes_per_token / 1e9,
            )
        pages = fit
    pool = PagePool(lm.layout, lm.device, pages, page_tokens)
    if lm.device.type == "cuda":
        pool.take_memory()  # now: the next model's pool is sized from what this one leaves free
    return pool


def _activation_bytes(lm: LoadedModel, max_rows: int, context: int) -> int:
    """A bound on what one step's activations take on the device beyond the weights and the KV: the
    widest intermediate (the fused gate/up product) and the logits of every row, in float32, twice; and
    on CUDA the paged attention's partials of a layer at the longest context."""
    config = lm.model.config
    widest = 2 * int(getattr(config, "intermediate_size", 0) or 0) + int(
        getattr(config, "hidden_size", 0) or 0
    )
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    partials = 0
    if lm.device.type == "cuda" and heads:
        partials = triton_attention.partial_bytes(max_rows, heads, lm.layout.head_dim, context)
    return 2 * 4 * max_rows * (widest + vocab) + partials
