"""Attention whose every row is computed the same way whatever shares its call: reuse and batching exact.

Why: torch's CPU flash attention splits a row's keys into blocks whose size depends on the call (the
chunk's query count, the longest job's length), and a GEMM of 3 rows (one decoding token's query heads
that share a K/V head) is computed by another kernel than a GEMM of 6 or more. Either way a token's
attention output, and so the K/V of every later layer, rounds differently when the token is decoded alone,
beside other jobs, or inside a prompt chunk of some length; greedy decoding then turns one rounding into
another answer (docs/engine.md, "Batch invariance"). This module fixes every shape a row's arithmetic
sees, so a row's bits depend on its own query and keys only:

- keys are read in whole blocks of KEY_BLOCK (64): a row of length L attends over the padded length
  ceil(L / 64) * 64, or more; keys past L are masked to -inf, so they add exact zeros to the softmax's
  sums, at positions the vectorized sums lay out the same way whatever the padded length (lanes by
  index: a longer row only appends zero lanes); the weighted sum of values is one product per key block
  (always 64 keys), the blocks added in order, so more blocks only add zero blocks at the end;
- the matrix products have at least MIN_QUERY_ROWS (8) query rows (zero rows are added to a decoding
  token's 3 heads), so the row count never selects the small-matrix kernel;
- scores, softmax and the weighted sum run in float32 whatever the model's dtype (as torch's own math
  attention does on the CPU), so bfloat16 and float16 take the same float32 kernels.

Measured, not assumed (tests/test_exact_attention.py holds every row of prompt chunks of any length and
offset, and of batched decoding of mixed lengths, to the row computed alone, bit for bit, in float32 and
bfloat16): the products' per-element arithmetic does not depend on the number of rows (from 6 on), on
the padded key count, or on the batch count, on the CPUs this runs on (MKL's float32 products on AVX2
and AVX-512; torch's own bfloat16 products). What it costs against the flash kernel: docs/benchmarks.md.
"""

from __future__ import annotations

import torch

KEY_BLOCK = 64
MIN_QUERY_ROWS = 8
# Prompt chunks attend in blocks of this many query rows, each over the keys its last row sees (rounded
# up to KEY_BLOCK): the masked upper triangle then costs at most one block's worth of keys per row.
QUERY_BLOCK = 128


def padded_keys(length: int) -> int:
    """The keys a row of `length` keys attends over (a multiple of KEY_BLOCK; a pool whose capacity is not
    one cuts every row's span at that capacity alike)."""
    return -(-length // KEY_BLOCK) * KEY_BLOCK


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v in float32: q [b, m, d] (m >= MIN_QUERY_ROWS), k and v [b, P, d]
    with P a multiple of KEY_BLOCK, bias broadcastable to [b, m, P] (0 or -inf); [b, m, d] out in
    float32. The weighted sum of values is taken per key block (products of exactly KEY_BLOCK keys) and
    the blocks' sums added in order: one product over all P keys splits its sums by P (measured)."""
    scores = torch.baddbmm(bias, q.float(), k.float().transpose(-1, -2), alpha=scale)
    weights = torch.softmax(scores, dim=-1)
    b, m, span = weights.shape
    blocks = span // KEY_BLOCK
    per_block = weights.view(b, m, blocks, KEY_BLOCK).transpose(1, 2)  # [b, blocks, m, KEY_BLOCK]
    values = v.float().reshape(b, blocks, KEY_BLOCK, v.shape[-1])
    return torch.matmul(per_block, values).sum(dim=1)


def decode_bias(lengths: list[int], capacity: int, device: torch.device) -> torch.Tensor:
    """The additive mask of decoding rows of these lengths, [rows, 1, span] in float32 (span: the longest
    row's padded length, at most the pool's capacity); made once per step, used by every layer."""
    span = min(padded_keys(max(lengths)), capacity)
    hidden = torch.arange(span)[None, :] >= torch.tensor(lengths)[:, None]
    return torch.zeros(len(lengths), 1, span).masked_fill_(hidden[:, None], float("-inf")).to(device)


def decode_rows(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decoding token per slot: queries [rows, heads, d] against keys/values [rows, kv_heads, >= P, d]
    (a slot per row), masked by `decode_bias` of the rows' lengths; [rows, heads, d] out in the queries'
    dtype. A row's result is the one it gets alone."""
    rows, heads, d = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    span = bias.shape[-1]
    q = queries.reshape(rows * kv_heads, group, d)
    if group < MIN_QUERY_ROWS:
        q = torch.cat((q, q.new_zeros(rows * kv_heads, MIN_QUERY_ROWS - group, d)), dim=1)
    k = keys[:, :, :span].reshape(rows * kv_heads, span, d)
    v = values[:, :, :span].reshape(rows * kv_heads, span, d)
    out = _attend(q, k, v, bias.repeat_interleave(kv_heads, dim=0), scale)
    return out[:, :group].reshape(rows, heads, d).to(queries.dtype)


def prefill_bias(
    past: int, first: int, end: int, span: int, group: int, device: torch.device
) -> torch.Tensor:
    """The causal mask of a prompt chunk's query block [first, end) after `past` stored tokens, a row per
    (token, query head) as prefill_rows lays them out, padded to MIN_QUERY_ROWS rows: [1, m, span]."""
    position = torch.arange(past + first, past + end)
    hidden = torch.arange(span)[None, :] > position[:, None]
    bias = torch.zeros(end - first, span).masked_fill_(hidden, float("-inf")).repeat_interleave(group, dim=0)
    if bias.shape[0] < MIN_QUERY_ROWS:
        bias = torch.cat((bias, bias.new_zeros(MIN_QUERY_ROWS - bias.shape[0], span)))
    return bias[None].to(device)


def prefill_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    past: int,
    scale: float,
    biases: dict[tuple[int, int, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A prompt chunk of one slot: queries [n, heads, d] of the tokens at positions past .. past + n - 1
    against that slot's keys/values [kv_heads, >= padded(past + n), d], causal; [n, heads, d] out.
    `biases`: the step's masks by (past, first, end), made by the first layer, reused by the others."""
    n, heads, d = queries.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    out = queries.new_empty(queries.shape)
    biases = {} if biases is None else biases
    for first in range(0, n, QUERY_BLOCK):
        end = min(n, first + QUERY_BLOCK)
        block = end - first
        span = min(padded_keys(past + end), keys.shape[1])
        bias = biases.get((past, first, end))
        if bias is None:
            bias = biases[(past, first, end)] = prefill_bias(past, first, end, span, group, queries.device)
        # [kv_heads, block * group, d]: the block's tokens' query heads of each K/V head as rows
        q = queries[first:end].reshape(block, kv_heads, group, d).permute(1, 0, 2, 3).reshape(kv_heads, -1, d)
        real = q.shape[1]
        if real < MIN_QUERY_ROWS:
            q = torch.cat((q, q.new_zeros(kv_heads, MIN_QUERY_ROWS - real, d)), dim=1)
        o = _attend(q, keys[:, :span], values[:, :span], bias, scale)[:, :real]
        out[first:end] = o.reshape(kv_heads, block, group, d).permute(1, 0, 2, 3).reshape(block, heads, d)
    return out
