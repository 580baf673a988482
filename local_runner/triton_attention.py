"""Paged attention on CUDA in Triton: every token of a step, decoding or prefilling, attends to its own
job's keys up to its own position, in one launch per layer (plus a merge for long rows).

Why a kernel of our own: it reads keys through the jobs' page tables (kv_pages.py), so the pool is
shared by every job and nothing is gathered; and it computes a row the same way whatever shares its
launch, so reuse equals recompute and batched equals alone (docs/engine.md, "Batch invariance"):

- work item: up to BLOCK_M query rows of ONE job and K/V head: consecutive tokens of the job, each with
  the query heads that share that K/V head (a decoding token's GROUP heads, or a prompt chunk's tokens x
  GROUP). A row's scores are one dot product per key (tensor cores, the same tile shape for every item),
  independent of the other rows of its item;
- keys in fixed blocks of BLOCK_N from key 0, inside fixed partitions of PARTITION keys: the online
  softmax runs block after block within a partition, a row's keys past its own position masked to -inf,
  whose weights are exactly 0 (a row in an item with longer rows only gets extra all-zero blocks, which
  leave its sums as they are);
- a row of at most PARTITION keys is finished by its partition's program (acc / l); a longer row's
  partials (m, l, acc per partition) are merged by `_merge_kernel` in partition order. Whether a row is
  merged depends on its own length only.

Dtype-generic (bfloat16, float16, float32). On a CPU the kernels run under TRITON_INTERPRET=1 for the
tests (the kernels are decorated at first use, after the test set the variable); the interpreter's
bfloat16 products are wrong, so the tests use float16 and float32 there.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

try:  # torch's CUDA builds ship Triton; a CPU install may lack it (then nothing here is called)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

BLOCK_M = 64  # query rows per work item (tokens x GROUP)
BLOCK_N = 64  # keys per block at most: the largest power of two up to it that divides the page
PARTITION = 4096  # keys per partition (a multiple of BLOCK_N)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionConfig:
    """A launch's tiles and pipeline. One config serves every launch of a model: a row's sums follow
    the layout the tiles and warps give, so launches with two configs could round one row two ways.
    The defaults are the engine's first guesses; at a model's first start on a device the engine times
    them against the alternatives and keeps the fastest (kernel_choice.py)."""

    block_m: int = BLOCK_M  # query rows per work item
    block_n: int = BLOCK_N  # keys per block at most (block_keys)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        # tl.dot takes tiles of at least 16 a side, Triton's blocks are powers of two, a page holds whole
        # key blocks (pages are multiples of 16 tokens) and a partition whole blocks
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1) or PARTITION % value:
                raise ValueError(f"{name} {value}: a power of two, at least 16, dividing {PARTITION}")


# The engine's configs. Float32's products are FMAs in IEEE float32 (no tensor cores), and the 16-bit
# tile's operands do not fit in registers then: compiled for sm_90 it spills kilobytes a thread, where
# key blocks of 16 on 8 warps spill nothing (python -m bench.gpu.triton_aot --dtype float32).
ENGINE_ATTENTION = AttentionConfig()
ENGINE_ATTENTION_FLOAT32 = AttentionConfig(block_n=16, num_warps=8)


def config_for(dtype: torch.dtype) -> AttentionConfig:
    """The engine's config for a model computing in `dtype`."""
    return ENGINE_ATTENTION_FLOAT32 if dtype == torch.float32 else ENGINE_ATTENTION


def available() -> bool:
    return triton is not None


def takes(head_dim: int, group: int) -> bool:
    """Whether the kernel computes heads of this size, `group` query heads per K/V head: a work item's
    BLOCK_M rows hold at least one token's heads of its K/V head (past that, heads would be dropped)."""
    return 16 <= head_dim <= 256 and group <= BLOCK_M


def ready(head_dim: int, group: int = 1) -> bool:
    """Whether the kernel serves such a model here (CUDA and Triton present)."""
    return triton is not None and torch.cuda.is_available() and takes(head_dim, group)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: float32 products in IEEE float32, since Triton's default on NVIDIA
    rounds float32 inputs to TF32 (10 bits of mantissa: what a float32 model, or a test against torch's
    float32, does not expect); for 16-bit inputs the default, which rounds nothing."""
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass
class KernelPlan:
    """One step's work items for one pool, made once on the host and used by every layer."""

    tables: torch.Tensor  # [jobs, width] int32: each job's pages
    lengths: torch.Tensor  # [tokens] int32: each token's keys
    item_job: torch.Tensor  # [items] int32: the item's row of `tables`
    item_row: torch.Tensor  # [items] int32: its first token's row in the step's queries
    item_count: torch.Tensor  # [items] int32: its tokens
    item_length: torch.Tensor  # [items] int32: its first token's keys (token i has item_length + i)
    items: int
    partitions: int  # the most partitions any row has
    group: int
    tokens: int
    config: AttentionConfig  # the model's (kernel_choice.py): one for every launch of a model


def plan(
    tables: torch.Tensor,
    jobs: list[int],
    lengths: list[int],
    heads: int,
    kv_heads: int,
    config: AttentionConfig,
) -> KernelPlan:
    """Work items for a step's tokens (`jobs[t]`: token t's row of `tables`; `lengths[t]`: its keys):
    runs of consecutive tokens of one job, at most config.block_m // group tokens each."""
    group = heads // kv_heads
    if group > config.block_m:
        raise ValueError(f"{group} query heads per K/V head: the kernel holds at most {config.block_m}")
    per_item = max(1, config.block_m // group)
    item_job, item_row, item_count, item_length = [], [], [], []
    t = 0
    while t < len(jobs):
        n = 1
        while n < per_item and t + n < len(jobs) and jobs[t + n] == jobs[t]:
            n += 1
        item_job.append(jobs[t])
        item_row.append(t)
        item_count.append(n)
        item_length.append(lengths[t])
        t += n
    device = tables.device

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return KernelPlan(
        tables=tables.to(torch.int32),
        lengths=tensor(lengths),
        item_job=tensor(item_job),
        item_row=tensor(item_row),
        item_count=tensor(item_count),
        item_length=tensor(item_length),
        items=len(item_job),
        partitions=partitions_of(max(lengths)),
        group=group,
        tokens=len(jobs),
        config=config,
    )


def block_keys(page_tokens: int, most: int) -> int:
    """Keys per block: at most `most`, a power of two that divides the page (pages hold multiples of 16),
    so a block never straddles two pages; PARTITION is a multiple of it."""
    block = most
    while page_tokens % block:
        block //= 2
    return block


def partitions_of(length: int) -> int:
    """How many partitions a row of `length` keys spans."""
    return max(1, -(-length // PARTITION))


def partial_bytes(tokens: int, heads: int, head_dim: int, keys: int) -> int:
    """What `attend` allocates for the partials of a step of `tokens` rows up to `keys` keys (float32 acc
    over BLOCK_D, then m and l, per row, head and partition; nothing where no row passes a partition)."""
    partitions = partitions_of(keys)
    if partitions == 1:
        return 0
    block_d = 1 << (head_dim - 1).bit_length()  # triton.next_power_of_2, without Triton
    return 4 * tokens * heads * partitions * (block_d + 2)


def attend(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, meta: KernelPlan, scale: float
) -> torch.Tensor:
    """q [tokens, heads, dim]; k_pages, v_pages [pages, kv_heads, page_tokens, dim] (a layer of the
    pool, pages a stride apart); [tokens, heads, dim] out."""
    tokens, heads, dim = q.shape
    kv_heads, page_tokens = k_pages.shape[1], k_pages.shape[2]
    config = meta.config
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(dim)
    if meta.partitions > 1:
        part_acc = torch.empty(tokens, heads, meta.partitions, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(tokens, heads, meta.partitions, 2, dtype=torch.float32, device=q.device)
    else:  # nothing is merged: never written
        part_acc = part_ml = torch.empty(1, dtype=torch.float32, device=q.device)
    kernels = _kernels()
    kernels.attention[(meta.items, kv_heads, meta.partitions)](
        q,
        k_pages,
        v_pages,
        out,
        part_acc,
        part_ml,
        meta.tables,
        meta.item_job,
        meta.item_row,
        meta.item_count,
        meta.item_length,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        v_pages.stride(0),
        v_pages.stride(1),
        v_pages.stride(2),
        out.stride(0),
        out.stride(1),
        meta.tables.stride(0),
        meta.partitions,
        GROUP=meta.group,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK_M=config.block_m,
        BLOCK_N=block_keys(page_tokens, config.block_n),
        PAGE=page_tokens,
        PARTITION=PARTITION,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if meta.partitions > 1:
        kernels.merge[(tokens, heads)](
            out,
            part_acc,
            part_ml,
            meta.lengths,
            out.stride(0),
            out.stride(1),
            meta.partitions,
            HEAD_DIM=dim,
            BLOCK_D=block_d,
            PARTITION=PARTITION,
            num_warps=4,
        )
    return out


def warm_long_rows(
    k_pages: torch.Tensor, v_pages: torch.Tensor, heads: int, config: AttentionConfig | None = None
) -> None:
    """Run `attend` once on one row of PARTITION + 1 keys whose every page is page 0 of this layer (only
    read), so that the merge kernel is compiled at start. The warm-up's steps are short; without this the
    first row past a partition would wait for the merge's compile on the serving thread."""
    kv_heads, page_tokens, dim = k_pages.shape[1], k_pages.shape[2], k_pages.shape[3]
    length = PARTITION + 1
    tables = torch.zeros(1, -(-length // page_tokens), dtype=torch.int32, device=k_pages.device)
    q = torch.zeros(1, heads, dim, dtype=k_pages.dtype, device=k_pages.device)
    config = config or config_for(q.dtype)
    attend(q, k_pages, v_pages, plan(tables, [0], [length], heads, kv_heads, config), 1.0)


def _attention_kernel(
    Q,
    K,
    V,
    Out,
    PartAcc,
    PartML,
    tables,
    item_job,
    item_row,
    item_count,
    item_length,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kh,
    stride_kt,
    stride_vp,
    stride_vh,
    stride_vt,
    stride_ot,
    stride_oh,
    stride_table,
    partitions,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PARTITION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    job = tl.load(item_job + item)
    row0 = tl.load(item_row + item)
    count = tl.load(item_count + item)
    first_length = tl.load(item_length + item)
    longest = first_length + count - 1
    key_start = part * PARTITION
    if key_start < longest:
        key_end = tl.minimum(key_start + PARTITION, longest)
        offs_m = tl.arange(0, BLOCK_M)
        token = offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_ok = token < count
        row_length = first_length + token
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(
            Q + (row0 + token)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = tables + job * stride_table
        for start in range(key_start, key_end, BLOCK_N):
            page = tl.load(table + start // PAGE).to(tl.int64)
            offs_n = start + tl.arange(0, BLOCK_N)
            in_page = offs_n % PAGE
            key_ok = offs_n < key_end
            k = tl.load(
                K + page * stride_kp + kvh * stride_kh + in_page[:, None] * stride_kt + offs_d[None, :],
                mask=key_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            s = tl.where(offs_n[None, :] < row_length[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m - m_use)
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(
                V + page * stride_vp + kvh * stride_vh + in_page[:, None] * stride_vt + offs_d[None, :],
                mask=key_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        has = row_ok & (row_length > key_start)
        single = row_length <= PARTITION
        done = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        out_rows = Out + (row0 + token)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_rows, done.to(Out.dtype.element_ty), mask=(has & single)[:, None] & d_ok[None, :])
        partial = has & (row_length > PARTITION)
        heads_total = tl.num_programs(1) * GROUP
        # int64: slots x BLOCK_D pass 2**31 at long contexts times large steps (the buffers are that big)
        slot = ((row0 + token) * heads_total + head).to(tl.int64) * partitions + part
        tl.store(
            PartAcc + slot[:, None] * BLOCK_D + offs_d[None, :], acc, mask=partial[:, None] & d_ok[None, :]
        )
        tl.store(PartML + slot * 2, m, mask=partial)
        tl.store(PartML + slot * 2 + 1, denom, mask=partial)


def _merge_kernel(
    Out,
    PartAcc,
    PartML,
    lengths,
    stride_ot,
    stride_oh,
    partitions,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    length = tl.load(lengths + token)
    parts = (length + PARTITION - 1) // PARTITION
    if parts > 1:
        base = (token * heads + head).to(tl.int64) * partitions
        top = tl.full([1], float("-inf"), tl.float32)
        for p in range(0, parts):
            top = tl.maximum(top, tl.load(PartML + (base + p) * 2 + tl.arange(0, 1)))
        offs_d = tl.arange(0, BLOCK_D)
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for p in range(0, parts):
            m = tl.load(PartML + (base + p) * 2 + tl.arange(0, 1))
            denom = tl.load(PartML + (base + p) * 2 + 1 + tl.arange(0, 1))
            w = tl.exp2(m - top)
            total = total + denom * w
            acc = acc + tl.load(PartAcc + (base + p) * BLOCK_D + offs_d) * w
        out = acc / total
        tl.store(
            Out + token * stride_ot + head * stride_oh + offs_d,
            out.to(Out.dtype.element_ty),
            mask=offs_d < HEAD_DIM,
        )


@dataclass(frozen=True)
class _Kernels:
    attention: Any
    merge: Any


@functools.cache
def _kernels() -> _Kernels:
    """The kernels, decorated at first use (so a test can ask for Triton's interpreter first). The integers
    that change from step to step (the page-table width, the partitions) are not specialized on: Triton
    would otherwise compile another kernel, on the serving thread, the first time one is 1 or a multiple
    of 16."""
    return _Kernels(
        attention=triton.jit(_attention_kernel, do_not_specialize=["stride_table", "partitions"]),
        merge=triton.jit(_merge_kernel, do_not_specialize=["partitions"]),
    )


def reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: list[list[int]],
    jobs: list[int],
    lengths: list[int],
    scale: float,
) -> torch.Tensor:
    """What `attend` computes, in float32 with torch's operations, token by token (for the tests)."""
    tokens, heads, dim = q.shape
    kv_heads, page_tokens = k_pages.shape[1], k_pages.shape[2]
    group = heads // kv_heads
    out = torch.empty(tokens, heads, dim, dtype=torch.float32)
    for t in range(tokens):
        n = lengths[t]
        pages = tables[jobs[t]][: math.ceil(n / page_tokens)]
        k = k_pages[pages].float().transpose(0, 1).reshape(kv_heads, -1, dim)[:, :n]
        v = v_pages[pages].float().transpose(0, 1).reshape(kv_heads, -1, dim)[:, :n]
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hkd->hk", q[t].float(), k) * scale
        out[t] = torch.einsum("hk,hkd->hd", torch.softmax(scores, dim=-1), v)
    return out
