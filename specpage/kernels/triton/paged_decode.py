"""Paged attention for one query token per sequence (plain decoding).

One program per (sequence, KV head, context partition) serves every query
head of the group at once, so each K/V row is read from the cache once per
KV head: the group's heads are the rows of a tile padded to at least 16 (the
smallest tl.dot a GPU accepts). The program walks its part of the context
TILE positions at a time, looking up each position's block in the block
table, and keeps an online softmax (flash-decoding) in fp32.

With one partition the kernel writes the output directly. When sequences and
KV heads alone would leave most SMs idle, the context is split into
partitions (split-K); each writes its normalized partial output and its
log-sum-exp, and the launcher merges them with a softmax over partitions.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from specpage.kernels.triton import (
    PagedSpans,
    check_attention,
    dot_config,
    gather_context_ref,
    require,
)

__all__ = ["paged_decode", "paged_decode_ref"]

TILE = 32  # context positions per loop iteration
# A partition shorter than this costs more in partial results than it gains.
MIN_PARTITION = 256
LN2 = math.log(2.0)


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [num_seqs, heads, num_partitions, head_dim]; the output itself when unsplit
    lse_ptr,  # [num_seqs, heads, num_partitions] fp32, written when WRITE_LSE
    q_ptr,  # [num_seqs, heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int64
    context_lens_ptr,  # [num_seqs] int64
    qk_scale,  # softmax scale * log2(e): the exponentials run in base 2
    partition_size,
    stride_q_seq,
    stride_q_head,
    stride_out_seq,
    stride_out_head,
    stride_out_part,
    stride_lse_seq,
    stride_lse_head,
    stride_table_seq,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    GROUPS: tl.constexpr,
    GROUPS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    LN2: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = part * partition_size
    end = tl.minimum(start + partition_size, context_len)

    rows = tl.arange(0, GROUPS_PADDED)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUPS + rows  # [GROUPS_PADDED]
    row_mask = rows < GROUPS
    q_offsets = seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)

    m = tl.full([GROUPS_PADDED], float("-inf"), tl.float32)  # running max, log2 units
    row_sum = tl.zeros([GROUPS_PADDED], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([GROUPS_PADDED, HEAD_DIM], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_table_seq
    v_cache_ptr = cache_ptr + stride_cache_kv
    for tile_start in range(start, end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        valid = positions < end
        block = tl.load(table_ptr + positions // BLOCK_SIZE, mask=valid, other=0)  # int64
        row_offsets = (
            block * stride_cache_block
            + (positions % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )  # [TILE] int64
        kv_offsets = row_offsets[:, None] + dims[None, :]  # [TILE, HEAD_DIM]
        k = tl.load(cache_ptr + kv_offsets, mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        v = tl.load(v_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0).to(DOT_DTYPE)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))  # [GROUPS_PADDED, TILE]
        # Every tile holds a valid position, so m_new is finite from the first one on.
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m = m_new

    # A partition past a short sequence's end saw nothing: output 0, weight 0.
    has_context = row_sum > 0
    l_safe = tl.where(has_context, row_sum, 1.0)
    out = acc / l_safe[:, None]
    out_offsets = (
        seq * stride_out_seq
        + heads[:, None] * stride_out_head
        + part * stride_out_part
        + dims[None, :]
    )
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    if WRITE_LSE:
        lse = tl.where(has_context, (m + tl.log2(l_safe)) * LN2, float("-inf"))
        lse_offsets = seq * stride_lse_seq + heads * stride_lse_head + part
        tl.store(lse_ptr + lse_offsets, lse, mask=row_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_partition_size(q: torch.Tensor, kv_heads: int, max_context: int) -> int:
    """Split the context only when (sequence, KV head) programs alone would
    not cover the GPU twice over."""
    whole = triton.cdiv(max(max_context, 1), TILE) * TILE
    if q.device.type != "cuda":
        return whole
    programs = q.shape[0] * kv_heads
    wanted = triton.cdiv(2 * _num_sms(q.device), programs)
    partitions = max(1, min(wanted, max_context // MIN_PARTITION))
    if partitions == 1:
        return whole
    return triton.cdiv(triton.cdiv(max_context, partitions), TILE) * TILE


def _check(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: PagedSpans,
    out: torch.Tensor | None,
    partition_size: int | None,
) -> int:
    groups = check_attention(q, cache, meta, out)
    num_seqs = meta.context_lens.shape[0]
    require(
        meta.max_query == 1 and q.shape[0] == num_seqs,
        f"paged_decode takes one query token per sequence: got {q.shape[0]} tokens for "
        f"{num_seqs} sequences (max_query {meta.max_query}); use paged_prefill",
    )
    require(
        partition_size is None or (partition_size > 0 and partition_size % TILE == 0),
        f"partition_size must be a positive multiple of {TILE}, got {partition_size}",
    )
    return groups


def paged_decode(
    q: torch.Tensor,  # [num_seqs, heads, head_dim], cache dtype
    cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    meta: PagedSpans,  # block_tables, context_lens, max_query == 1, max_context
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs, heads, head_dim]; allocated when None
    partition_size: int | None = None,  # context positions per split-K partition
) -> torch.Tensor:
    """Attention of each sequence's one new token over its whole context:
    returns out [num_seqs, heads, head_dim]."""
    groups = _check(q, cache, meta, out, partition_size)
    num_seqs, heads, head_dim = q.shape
    kv_heads, block_size = cache.shape[3], cache.shape[2]
    if out is None:
        out = q.new_empty(q.shape)
    if num_seqs == 0:
        return out
    if partition_size is None:
        partition_size = _default_partition_size(q, kv_heads, meta.max_context)
    num_partitions = max(1, triton.cdiv(meta.max_context, partition_size))
    split = num_partitions > 1
    if split:
        partial = q.new_empty(num_seqs, heads, num_partitions, head_dim, dtype=torch.float32)
        lse = q.new_empty(num_seqs, heads, num_partitions, dtype=torch.float32)
        out_strides = partial.stride()[:3]
    else:
        partial, lse = out, out  # lse is never touched without WRITE_LSE
        out_strides = (out.stride(0), out.stride(1), 0)
    dot_dtype, dot_precision = dot_config(q.dtype, _paged_decode_kernel)
    grid = (num_seqs, kv_heads, num_partitions)
    _paged_decode_kernel[grid](
        partial,
        lse,
        q,
        cache,
        meta.block_tables,
        meta.context_lens,
        scale / LN2,
        partition_size,
        q.stride(0),
        q.stride(1),
        *out_strides,
        lse.stride(0) if split else 0,
        lse.stride(1) if split else 0,
        meta.block_tables.stride(0),
        *cache.stride()[:4],
        GROUPS=groups,
        GROUPS_PADDED=max(16, triton.next_power_of_2(groups)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=TILE,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        WRITE_LSE=split,
        LN2=LN2,
        num_warps=4,
        num_stages=3,
    )
    if split:
        weights = torch.softmax(lse, dim=-1)  # [num_seqs, heads, num_partitions]
        out.copy_((partial * weights[..., None]).sum(dim=2))
    return out


def paged_decode_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: PagedSpans,
    scale: float,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Pure-torch twin of `paged_decode` (fp32 math; partition_size changes
    nothing but rounding)."""
    groups = _check(q, cache, meta, out, partition_size)
    if out is None:
        out = q.new_empty(q.shape)
    for seq in range(q.shape[0]):
        context_len = int(meta.context_lens[seq])
        k, v = gather_context_ref(cache, meta.block_tables[seq], context_len, groups)
        scores = torch.einsum("hd,nhd->hn", q[seq].float(), k) * scale
        out[seq] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
