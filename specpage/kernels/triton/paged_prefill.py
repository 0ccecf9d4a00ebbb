"""Paged attention for multi-token spans: prefill chunks (with or without
earlier context) and the k + 1 positions of a verification, causal inside
each span, spans of different lengths in one launch.

One program per (sequence, KV head, row tile). A span's rows are its
(token, query head of the group) pairs, token-major, so a short span still
fills a tile: 5 verification tokens x 4 heads = 20 rows. Tiles hold at least
16 rows (the smallest tl.dot a GPU accepts); tiles past a span's end exit at
once. Query token i of a span of n tokens in a sequence with context_len
positions sits at position context_len - n + i and attends to positions
0 .. that position; the loop stops at the tile's last token's position.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specpage.kernels.triton import (
    PagedSpans,
    check_attention,
    check_query_start,
    dot_config,
    gather_context_ref,
)

__all__ = ["paged_prefill", "paged_prefill_ref"]

TILE = 32  # context positions per loop iteration
MAX_BLOCK_M = 64  # rows per program
LN2 = math.log(2.0)


@triton.jit
def _paged_prefill_kernel(
    out_ptr,  # [num_tokens, heads, head_dim]
    q_ptr,  # [num_tokens, heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int64
    context_lens_ptr,  # [num_seqs] int64
    query_start_ptr,  # [num_seqs + 1] int64
    qk_scale,  # softmax scale * log2(e): the exponentials run in base 2
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_table_seq,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    # Later row tiles see more context; starting them first shortens the tail.
    row_tile = tl.num_programs(2) - 1 - tl.program_id(2)
    first_token = tl.load(query_start_ptr + seq)  # int64 row of the span's first token
    query_len = (tl.load(query_start_ptr + seq + 1) - first_token).to(tl.int32)
    first_row = row_tile * BLOCK_M
    if first_row < query_len * GROUPS:
        context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
        rows = first_row + tl.arange(0, BLOCK_M)
        token = rows // GROUPS  # [BLOCK_M] index inside the span
        heads = kv_head * GROUPS + rows % GROUPS  # [BLOCK_M]
        row_mask = token < query_len
        query_pos = context_len - query_len + token  # [BLOCK_M]
        dims = tl.arange(0, HEAD_DIM)
        q_offsets = (first_token + token) * stride_q_token + heads * stride_q_head  # int64
        q = tl.load(
            q_ptr + q_offsets[:, None] + dims[None, :], mask=row_mask[:, None], other=0.0
        ).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM]

        last_token = tl.minimum((first_row + BLOCK_M - 1) // GROUPS, query_len - 1)
        end = context_len - query_len + last_token + 1  # causal bound of the whole tile
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
        row_sum = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        table_ptr = block_tables_ptr + seq * stride_table_seq
        v_cache_ptr = cache_ptr + stride_cache_kv
        for tile_start in range(0, end, TILE):
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
            scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, TILE]
            # Position 0 is visible to every row, so m is finite after the first tile.
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            row_sum = row_sum * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m = m_new

        out = acc / row_sum[:, None]
        out_offsets = (first_token + token) * stride_out_token + heads * stride_out_head
        tl.store(
            out_ptr + out_offsets[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None],
        )


def _check(
    q: torch.Tensor, cache: torch.Tensor, meta: PagedSpans, out: torch.Tensor | None
) -> int:
    groups = check_attention(q, cache, meta, out)
    check_query_start(cache, meta)
    return groups


def paged_prefill(
    q: torch.Tensor,  # [num_tokens, heads, head_dim], cache dtype, spans in sequence order
    cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    meta: PagedSpans,  # block_tables, context_lens, query_start, max_query
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, heads, head_dim]; allocated when None
) -> torch.Tensor:
    """Causal attention of every span's tokens over their sequence's context:
    returns out [num_tokens, heads, head_dim]."""
    groups = _check(q, cache, meta, out)
    num_tokens, _, head_dim = q.shape
    kv_heads, block_size = cache.shape[3], cache.shape[2]
    if out is None:
        out = q.new_empty(q.shape)
    num_seqs = meta.context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    rows = meta.max_query * groups
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))
    dot_dtype, dot_precision = dot_config(q.dtype, _paged_prefill_kernel)
    grid = (num_seqs, kv_heads, triton.cdiv(rows, block_m))
    _paged_prefill_kernel[grid](
        out,
        q,
        cache,
        meta.block_tables,
        meta.context_lens,
        meta.query_start,
        scale / LN2,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        *cache.stride()[:4],
        GROUPS=groups,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        TILE=TILE,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        num_warps=4,
        num_stages=3,
    )
    return out


def paged_prefill_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: PagedSpans,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch twin of `paged_prefill` (fp32 math)."""
    groups = _check(q, cache, meta, out)
    if out is None:
        out = q.new_empty(q.shape)
    starts = meta.query_start.tolist()
    for seq, (first, last) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        context_len = int(meta.context_lens[seq])
        k, v = gather_context_ref(cache, meta.block_tables[seq], context_len, groups)
        query_pos = context_len - (last - first) + torch.arange(last - first, device=q.device)
        positions = torch.arange(context_len, device=q.device)
        visible = positions[None, :] <= query_pos[:, None]  # [span, context_len]
        scores = torch.einsum("thd,nhd->htn", q[first:last].float(), k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[first:last] = torch.einsum("htn,nhd->thd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
