"""Decode steps replayed as CUDA graphs: one graph per batch-size bucket, captured at start.

A decode step of a large model is a few hundred kernels whose launch (and Python) cost more than their
work; a graph replays all of them at once. A step whose every job decodes one token (the common step
of a serving engine) takes the graph of the smallest bucket that holds its jobs; the rows past them are
padding (they write into a page no job holds and their logits are dropped). Any other step (a prompt
chunk, a restore still arriving, more jobs than the largest bucket) runs eagerly.

Each bucket has one graph per class of key partitions (1, 4, 16, ... up to the longest context's): the
attention's grid spans a fixed number of partitions of PARTITION keys, and a graph sized for the longest
context would launch every row's empty partitions and a merge pass at every step of short chats. The
step takes the smallest class that holds its longest row. Which class runs never changes a result: a
row's partitions and their merge depend on its own length only (triton_attention.py).

The graphs read everything that changes from step to step out of one static buffer on the device
(token ids, positions, where each new K/V goes, each job's page table and key count), which one copy
from pinned host memory fills before the replay (vLLM's and nano-vllm's layout). The kernels are the
eager step's own, so a token decoded in a graph is computed as it would be eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from . import triton_attention
from .cuda_stack import CudaStack
from .kv_pages import PagePool
from .packed_attention import PackedPlan, PoolGroup
from .sampling import RowLogits, StepLogits
from .step import Work

log = logging.getLogger("attnstore.runner")


def buckets_up_to(most: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every 8 up to `most` (and `most`)."""
    sizes = [b for b in (1, 2, 4) if b < most] + list(range(8, most, 8)) + [most]
    return sorted(set(sizes))


def partition_classes_up_to(most: int) -> list[int]:
    """The partition counts graphs are captured for: powers of four below `most`, and `most`. A step
    launches at most four times the partitions its longest row needs (or the longest context's), and a
    bucket takes one capture per class (4 at 128k keys)."""
    classes = [1]
    while classes[-1] * 4 < most:
        classes.append(classes[-1] * 4)
    return sorted({*classes, most})


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab]: the replay's output


class DecodeGraphs:
    """Owns the graphs, their static inputs and the padding page; used on the worker's thread only."""

    def __init__(self, stack: CudaStack, pool: PagePool, most_jobs: int, most_keys: int) -> None:
        self.stack = stack
        self.pool = pool
        self.buckets = buckets_up_to(most_jobs)
        self.partition_classes = partition_classes_up_to(triton_attention.partitions_of(most_keys))
        self.width = pool.pages_for(most_keys)  # page-table columns: a job's most pages
        self.most_keys = most_keys
        self.pad_page = pool.allocate(1)[0]  # padding rows write here; no job ever holds it
        device = pool.device
        most = self.buckets[-1]
        # ids, positions, write page, write offset, keys: a row of `most` each; then the page tables
        self._columns = 5
        size = self._columns * most + most * self.width
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self._device = torch.zeros(size, dtype=torch.long, device=device)
        # What the attention kernel reads, in int32 as the eager steps' plans have it: compiled for int64
        # tables and counts it needs more registers than sm_90 has (bench/gpu/triton_aot.py). The K/V
        # writes keep int64 (an int32 index is converted at every indexed write: kernels per layer); each
        # replay casts the keys and tables over once. The tables start 16 bytes aligned (padded keys), as
        # Triton's pipelined loads want their pointers.
        self._keys_span = -(-most // 4) * 4
        self._kernel_inputs = torch.zeros(
            self._keys_span + most * self.width, dtype=torch.int32, device=device
        )
        self._arange = torch.arange(most, dtype=torch.int32, device=device)
        self._ones = torch.ones(most, dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int], _Graph] = {}  # by (bucket, partitions)
        self._pool_handle: object = None
        # recorded after each copy of the host buffer: the next _fill waits for it before rewriting the
        # buffer (a step whose rows never reach the host would otherwise let it race its own copy)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def _field(self, buf: Any, i: int) -> Any:
        """Field i of the static inputs in `buf` (the device tensor or the host buffer's numpy view)."""
        most = self.buckets[-1]
        return buf[i * most : (i + 1) * most]

    def _tables(self, buf: Any) -> Any:
        most = self.buckets[-1]
        return buf[self._columns * most :].reshape(most, self.width)

    def _kernel_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int32 keys [most] and tables [most, width] the attention kernel reads."""
        most = self.buckets[-1]
        keys = self._kernel_inputs[:most]
        return keys, self._kernel_inputs[self._keys_span :].view(most, self.width)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, plan: PackedPlan
    ) -> torch.Tensor:
        """A bucket's step: the kernel's int32 inputs cast from the copied static inputs, then the
        forward (both captured in the graph, so each replay does both)."""
        keys, tables = self._kernel_views()
        keys.copy_(self._field(self._device, 4))
        tables.copy_(self._tables(self._device))
        return self.stack.forward(ids, positions, keep, plan)

    def _plan(
        self, bucket: int, partitions: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PackedPlan]:
        """The static inputs of a bucket (views of the device buffers) and the plan its forward reads,
        the attention's grid spanning `partitions` partitions."""
        ids, positions, pages, offsets = (self._field(self._device, i)[:bucket] for i in range(4))
        keys, all_tables = self._kernel_views()
        lengths, tables = keys[:bucket], all_tables[:bucket]
        rows = self._arange[:bucket]
        meta = triton_attention.KernelPlan(
            tables=tables,
            lengths=lengths,
            item_job=rows,
            item_row=rows,
            item_count=self._ones[:bucket],
            item_length=lengths,
            items=bucket,
            partitions=partitions,
            group=self.stack.heads // self.stack.kv_heads,
            tokens=bucket,
            config=self.stack.attention,
        )
        group = PoolGroup(
            pool=self.pool,
            segments=[],
            rows=None,
            write_pages=pages,
            write_offsets=offsets,
            tables=tables,
            jobs=rows,
            lengths=lengths,
            pending=[],
            kernel_meta=meta,
        )
        plan = PackedPlan(
            [], batch_invariant=self.stack.invariant, _groups=[group], attention=self.stack.attention
        )
        return ids, positions, rows, plan

    def capture(self) -> None:
        """Capture every bucket's graphs, the largest first (the others reuse its memory pool). Each
        bucket's forward runs once eagerly first, at each class (Triton compiles its kernels, the merge's
        included, outside the capture; the partitions are not specialized on). The capture errs only on
        this thread's unsafe calls ("thread_local"): the store's threads may page-lock host memory
        meanwhile (kvtier/pinned_pool.py grows its pool at start), which "global" would count against
        the capture."""
        self._fill([])
        self._device.copy_(self._host)  # capture on padding rows (its page, one key), not on zeros
        self._pool_handle = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.pool.device)
        for bucket in reversed(self.buckets):
            for partitions in reversed(self.partition_classes):
                ids, positions, keep, plan = self._plan(bucket, partitions)
                self._forward(ids, positions, keep, plan)  # warm up, outside the graph
                torch.cuda.synchronize(self.pool.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool_handle, capture_error_mode="thread_local"):
                    logits = self._forward(ids, positions, keep, plan)
                self._graphs[bucket, partitions] = _Graph(graph, logits)
        torch.cuda.synchronize(self.pool.device)

    def partitions_for(self, work: list[Work]) -> int:
        """The smallest partition class that holds the step's longest row (its keys after this token)."""
        needed = triton_attention.partitions_of(max(w.kv.length + 1 for w in work))
        return next(c for c in self.partition_classes if c >= needed)

    def fits(self, work: list[Work]) -> bool:
        """A step the graphs can run: decoding jobs only, of this pool, none still restoring."""
        if len(work) > self.buckets[-1]:
            return False
        return all(
            len(w.tokens) == 1
            and w.want_logits
            and w.kv.pool is self.pool
            and not w.kv.restoring
            and len(w.kv.pages) <= self.width
            for w in work
        )

    def run(self, work: list[Work]) -> list[RowLogits | None]:
        """Replay the bucket's graph for these decoding jobs; their logits rows in `work`'s order.
        Advances each job's length."""
        bucket = next(b for b in self.buckets if b >= len(work))
        partitions = self.partitions_for(work)
        for w in work:
            w.kv.ensure(w.kv.length + 1)
        self._fill(work)
        self._device.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.pool.device))  # where the copy runs
        graph = self._graphs.get((bucket, partitions))
        if graph is not None:
            graph.graph.replay()
            # A copy: the graph's output is overwritten by its next replay, and a step that fell back to
            # running its jobs one by one (step_run's _isolated) replays it once per job before any
            # job's token is chosen from its rows.
            logits = graph.logits[: len(work)].clone()
        else:  # not captured (a CPU test): the replay's computation, run eagerly on the same inputs
            ids, positions, keep, plan = self._plan(bucket, partitions)
            logits = self._forward(ids, positions, keep, plan)
        step_logits = StepLogits(logits[: len(work)])
        for w in work:
            w.kv.length += 1
        return [step_logits.row(i) for i in range(len(work))]

    def _fill(self, work: list[Work]) -> None:
        """The host side of the static inputs: the jobs' rows, then padding rows (the padding page,
        position 0, one key)."""
        if self._copied is not None:  # the last copy has read the buffer (at once after a sampled step;
            self._copied.synchronize()  # an event never recorded returns at once too)
        most = self.buckets[-1]
        host = self._host.numpy()  # numpy's element writes: no torch call per row
        ids, positions, pages, offsets, lengths = (self._field(host, i) for i in range(5))
        tables = self._tables(host)
        size = self.pool.page_tokens
        n = len(work)
        for i, w in enumerate(work):
            at = w.kv.length
            ids[i] = w.tokens[0]
            positions[i] = at
            pages[i] = w.kv.pages[at // size]
            offsets[i] = at % size
            lengths[i] = at + 1
            row = w.kv.pages
            tables[i, : len(row)] = row
        if n < most:
            ids[n:] = 0
            positions[n:] = 0
            pages[n:] = self.pad_page
            offsets[n:] = 0
            lengths[n:] = 1
            tables[n:, 0] = self.pad_page

    def close(self) -> None:
        self._graphs.clear()
