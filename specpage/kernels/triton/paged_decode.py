"""Paged attention for short spans: one query token per sequence (plain
decoding) or a few (the k + 1 positions of a verification), causal inside
each span.

One program per (sequence, KV head, context partition) serves every query
row of the group at once, so each K/V row is read from the cache once per KV
head: a span's rows are its (token, query head of the group) pairs,
token-major, padded to a power of two of at least 16 (the smallest tl.dot a
GPU accepts). A plain decode with 4 query heads per KV head fills 4 of 16
rows; verifying 5 tokens fills 20 of 32, and reads the context no more often
than decoding one token does. The program walks its part of the context
`tile` positions at a time, looking up each position's block in the block
table, and keeps an online softmax (flash-decoding) in fp32.

With one partition the kernel writes the output directly. When sequences and
KV heads alone would not keep every SM busy `waves` times over, the context
is split into partitions (split-K, as FlashDecoding does); each writes its
normalized partial output and its log-sum-exp, and a second kernel merges
them with a softmax over partitions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specpage.kernels.triton import (
    PagedSpans,
    check_attention,
    check_query_start,
    dot_config,
    require,
)
from specpage.kernels.triton.paged_prefill import paged_prefill_ref

__all__ = ["DecodeConfig", "MAX_ROWS", "paged_decode", "paged_decode_ref", "takes_spans"]

# Query rows (span tokens x query heads per KV head) one program holds; longer
# spans go to paged_prefill.
MAX_ROWS = 64
LN2 = math.log(2.0)


@dataclass(frozen=True)
class DecodeConfig:
    """How the kernel is launched; any choice gives the same result up to
    rounding. `bench/kernels_gpu.py --sweep` times the alternatives."""

    # Chosen from bench/kernels_gpu.py --sweep on an H200 (Llama-3-8B's and
    # SmolLM2-135M's layers, 32 and 256 sequences x 2048 positions): a tile of
    # 128 while programs are few, 64 once they fill the SMs `many_waves` times;
    # the context split only while (sequence, KV head) programs alone leave
    # SMs idle, then into partitions that cover them `waves` times.
    tile: int = 128  # context positions per loop iteration, a power of two >= 16
    tile_when_many: int = 64
    many_waves: int = 4
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 4
    min_partition: int = 256  # never partitions shorter than this


DEFAULT_CONFIG = DecodeConfig()


@triton.jit
def _paged_spans_kernel(
    out_ptr,  # [num_tokens, heads, num_partitions, head_dim]; the output itself when unsplit
    lse_ptr,  # [num_tokens, heads, num_partitions] fp32, written when WRITE_LSE
    q_ptr,  # [num_tokens, heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int64
    context_lens_ptr,  # [num_seqs] int64
    query_start_ptr,  # [num_seqs + 1] int64
    qk_scale,  # softmax scale * log2(e): the exponentials run in base 2
    partition_size,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_out_part,
    stride_lse_token,
    stride_lse_head,
    stride_table_seq,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
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
    first_token = tl.load(query_start_ptr + seq)  # int64 row of the span's first token
    query_len = (tl.load(query_start_ptr + seq + 1) - first_token).to(tl.int32)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = part * partition_size
    end = tl.minimum(start + partition_size, context_len)

    rows = tl.arange(0, ROWS)
    token = rows // GROUPS  # [ROWS] index inside the span
    heads = kv_head * GROUPS + rows % GROUPS  # [ROWS]
    row_mask = token < query_len
    query_pos = context_len - query_len + token  # [ROWS]; padding rows see everything
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = (first_token + token) * stride_q_token + heads * stride_q_head  # int64
    q = tl.load(
        q_ptr + q_offsets[:, None] + dims[None, :], mask=row_mask[:, None], other=0.0
    ).to(DOT_DTYPE)  # [ROWS, HEAD_DIM]

    m = tl.full([ROWS], float("-inf"), tl.float32)  # running max, log2 units
    row_sum = tl.zeros([ROWS], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
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
        visible = valid[None, :] & (positions[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))  # [ROWS, TILE]
        m_new = tl.maximum(m, tl.max(scores, 1))
        # A span's early token may see nothing of a late partition: its max
        # stays -inf, and 0 stands in for it so that no -inf - -inf appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m = m_new

    # A row that saw nothing of this partition: output 0, weight 0.
    has_context = row_sum > 0
    l_safe = tl.where(has_context, row_sum, 1.0)
    out = acc / l_safe[:, None]
    out_offsets = (
        (first_token + token) * stride_out_token
        + heads * stride_out_head
        + part * stride_out_part
    )
    tl.store(
        out_ptr + out_offsets[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )
    if WRITE_LSE:
        lse = tl.where(has_context, (m + tl.log2(l_safe)) * LN2, float("-inf"))
        lse_offsets = (first_token + token) * stride_lse_token + heads * stride_lse_head + part
        tl.store(lse_ptr + lse_offsets, lse, mask=row_mask)


@triton.jit
def _merge_partitions_kernel(
    out_ptr,  # [num_tokens, heads, head_dim]
    partial_ptr,  # [num_tokens, heads, num_partitions, head_dim] fp32
    lse_ptr,  # [num_tokens, heads, num_partitions] fp32
    num_partitions,
    stride_out_token,
    stride_out_head,
    stride_partial_token,
    stride_partial_head,
    stride_partial_part,
    stride_lse_token,
    stride_lse_head,
    HEAD_DIM: tl.constexpr,
    PARTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    parts = tl.arange(0, PARTS)
    dims = tl.arange(0, HEAD_DIM)
    in_range = parts < num_partitions
    lse = tl.load(
        lse_ptr + token * stride_lse_token + head * stride_lse_head + parts,
        mask=in_range,
        other=float("-inf"),
    )
    # Partition 0 holds position 0, which every row sees: the max is finite.
    weights = tl.exp(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    partial = tl.load(
        partial_ptr
        + token * stride_partial_token
        + head * stride_partial_head
        + parts[:, None] * stride_partial_part
        + dims[None, :],
        mask=in_range[:, None],
        other=0.0,
    )  # [PARTS, HEAD_DIM]
    out = tl.sum(partial * weights[:, None], 0)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_tile(device: torch.device, programs: int, config: DecodeConfig) -> int:
    if device.type == "cuda" and programs >= config.many_waves * _num_sms(device):
        return config.tile_when_many
    return config.tile


def _default_partition_size(
    device: torch.device, programs: int, max_context: int, config: DecodeConfig, tile: int
) -> int:
    """Split the context only when (sequence, KV head) programs alone would
    leave SMs idle."""
    whole = triton.cdiv(max(max_context, 1), tile) * tile
    if device.type != "cuda" or programs >= _num_sms(device):
        return whole
    wanted = triton.cdiv(config.waves * _num_sms(device), programs)
    partitions = max(1, min(wanted, max_context // config.min_partition))
    if partitions == 1:
        return whole
    return triton.cdiv(triton.cdiv(max_context, partitions), tile) * tile


def takes_spans(max_query: int, groups: int) -> bool:
    """Whether spans of up to max_query tokens fit this kernel's rows."""
    return max_query * groups <= MAX_ROWS


def _check(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: PagedSpans,
    out: torch.Tensor | None,
    partition_size: int | None,
    config: DecodeConfig,
) -> int:
    groups = check_attention(q, cache, meta, out)
    check_query_start(cache, meta)
    num_seqs = meta.context_lens.shape[0]
    require(
        takes_spans(meta.max_query, groups),
        f"paged_decode takes spans of at most {MAX_ROWS // groups} tokens with {groups} query "
        f"heads per KV head, got max_query {meta.max_query}; use paged_prefill",
    )
    require(
        num_seqs <= q.shape[0] <= num_seqs * meta.max_query,
        f"paged_decode takes 1 to max_query ({meta.max_query}) tokens per sequence: got "
        f"{q.shape[0]} tokens for {num_seqs} sequences",
    )
    require(
        config.tile >= 16 and config.tile & (config.tile - 1) == 0,
        f"tile must be a power of two >= 16, got {config.tile}",
    )
    require(
        partition_size is None or (partition_size > 0 and partition_size % config.tile == 0),
        f"partition_size must be a positive multiple of the tile ({config.tile}), "
        f"got {partition_size}",
    )
    return groups


def paged_decode(
    q: torch.Tensor,  # [num_tokens, heads, head_dim], cache dtype, spans in sequence order
    cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    meta: PagedSpans,  # block_tables, context_lens, query_start, max_query, max_context
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, heads, head_dim]; allocated when None
    partition_size: int | None = None,  # context positions per split-K partition
    config: DecodeConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Causal attention of each sequence's short span over its context:
    returns out [num_tokens, heads, head_dim]."""
    groups = _check(q, cache, meta, out, partition_size, config)
    num_tokens, heads, head_dim = q.shape
    kv_heads, block_size = cache.shape[3], cache.shape[2]
    num_seqs = meta.context_lens.shape[0]
    if out is None:
        out = q.new_empty(q.shape)
    if num_tokens == 0:
        return out
    programs = num_seqs * kv_heads
    tile = _launch_tile(q.device, programs, config) if partition_size is None else config.tile
    if partition_size is None:
        partition_size = _default_partition_size(
            q.device, programs, meta.max_context, config, tile
        )
    num_partitions = max(1, triton.cdiv(meta.max_context, partition_size))
    split = num_partitions > 1
    if split:
        partial = q.new_empty(num_tokens, heads, num_partitions, head_dim, dtype=torch.float32)
        lse = q.new_empty(num_tokens, heads, num_partitions, dtype=torch.float32)
        out_strides = partial.stride()[:3]
        lse_strides = lse.stride()[:2]
    else:
        partial, lse = out, out  # lse is never touched without WRITE_LSE
        out_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    dot_dtype, dot_precision = dot_config(q.dtype, _paged_spans_kernel)
    _paged_spans_kernel[(num_seqs, kv_heads, num_partitions)](
        partial,
        lse,
        q,
        cache,
        meta.block_tables,
        meta.context_lens,
        meta.query_start,
        scale / LN2,
        partition_size,
        q.stride(0),
        q.stride(1),
        *out_strides,
        *lse_strides,
        meta.block_tables.stride(0),
        *cache.stride()[:4],
        GROUPS=groups,
        ROWS=max(16, triton.next_power_of_2(meta.max_query * groups)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=tile,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        WRITE_LSE=split,
        LN2=LN2,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split:
        _merge_partitions_kernel[(num_tokens, heads)](
            out,
            partial,
            lse,
            num_partitions,
            out.stride(0),
            out.stride(1),
            *partial.stride()[:3],
            *lse.stride()[:2],
            HEAD_DIM=head_dim,
            PARTS=triton.next_power_of_2(num_partitions),
            num_warps=4,
        )
    return out


def paged_decode_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: PagedSpans,
    scale: float,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
    config: DecodeConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Pure-torch twin of `paged_decode` (fp32 math; partition_size and config
    change nothing but rounding)."""
    _check(q, cache, meta, out, partition_size, config)
    return paged_prefill_ref(q, cache, meta, scale, out)
