"""The native CPU paged-attention kernel's contract
(specpage/kernels/cpu/paged_attention.cpp, built by specpage.kernels.cpu.native):
the head sizes it is built for and its pure-torch reference."""

from __future__ import annotations

import torch

from specpage.kernels.cpu.native import DISABLE_ENV, native_kernels

__all__ = ["DISABLE_ENV", "NATIVE_HEAD_DIMS", "NO_WINDOW", "native_kernels",
           "paged_attention_ref"]

NATIVE_HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # the head sizes the kernel is instantiated for
NO_WINDOW = 0  # the kernel's window argument for a layer that sees its whole context


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    query_start: torch.Tensor,  # [num_seqs + 1] int64
    context_lens: torch.Tensor,  # [num_seqs] int64, KV after this forward's writes
    scale: float,
    window: int = NO_WINDOW,
) -> torch.Tensor:
    """What the kernel computes, one sequence at a time in fp32: each span's
    token at row t, at position p = context - span + t, sees positions 0 ..
    p, or p - window + 1 .. p given a window. [num_tokens, heads * head_dim]."""
    heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = cache.shape[2], cache.shape[3]
    out = q.new_empty(q.shape[0], heads * head_dim)
    for s in range(context_lens.shape[0]):
        first, end, context = int(query_start[s]), int(query_start[s + 1]), int(context_lens[s])
        positions = torch.arange(context)
        blocks = block_tables[s, positions // block_size]
        k = cache[0, blocks, positions % block_size].float()  # [context, kv_heads, d]
        v = cache[1, blocks, positions % block_size].float()
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for t in (k, v))
        qs = q[first:end].float().transpose(0, 1)  # [heads, span, d]
        span = end - first
        query_pos = (context - span + torch.arange(span))[:, None]
        visible = positions[None, :] <= query_pos
        if window != NO_WINDOW:
            visible &= positions[None, :] > query_pos - window
        scores = (qs @ k.transpose(1, 2)) * scale
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[first:end] = (weights @ v).transpose(0, 1).reshape(span, -1).to(q.dtype)
    return out
