"""Scatter the new tokens' K and V rows into their cache slots.

Slot s lives in block s // block_size at offset s % block_size. A negative
slot skips its token (padding rows of a fixed-size batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specpage.kernels.triton import check_device, check_layer_cache, check_tensor, require

__all__ = ["write_kv", "write_kv_ref"]


@triton.jit
def _write_kv_kernel(
    cache_ptr,  # [2, num_blocks, block_size, kv_heads, head_dim]
    k_ptr,  # [num_tokens, kv_heads, head_dim]
    v_ptr,  # [num_tokens, kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    KV_HEADS: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token, all KV heads at once.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)  # int64: block * stride can pass 2**31
    if slot >= 0:
        heads = tl.arange(0, KV_HEADS_PADDED)
        dims = tl.arange(0, HEAD_DIM)
        mask = (heads < KV_HEADS)[:, None]
        block = slot // BLOCK_SIZE
        dst = (
            block * stride_cache_block
            + (slot % BLOCK_SIZE) * stride_cache_slot
            + heads[:, None] * stride_cache_head
            + dims[None, :]
        )  # [KV_HEADS_PADDED, HEAD_DIM]
        k_src = token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :]
        v_src = token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :]
        tl.store(cache_ptr + dst, tl.load(k_ptr + k_src, mask=mask), mask=mask)
        tl.store(cache_ptr + stride_cache_kv + dst, tl.load(v_ptr + v_src, mask=mask), mask=mask)


def _check(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _, _, kv_heads, head_dim = check_layer_cache(cache)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    num_tokens = slot_mapping.shape[0]
    for name, rows in (("k", k), ("v", v)):
        check_tensor(name, rows, 3, (cache.dtype,))
        require(
            tuple(rows.shape) == (num_tokens, kv_heads, head_dim),
            f"{name} must be [num_tokens, kv_heads, head_dim] = "
            f"{[num_tokens, kv_heads, head_dim]}, got {list(rows.shape)}",
        )
        require(
            rows.stride(-1) == 1,
            f"{name} must have unit stride along head_dim, got strides {rows.stride()}",
        )
    require(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    check_device(cache, k=k, v=v, slot_mapping=slot_mapping)


def write_kv(
    cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim], cache dtype
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim], cache dtype
    slot_mapping: torch.Tensor,  # [num_tokens] int64 flat slot, < 0 = skip
) -> None:
    """Write each token's K and V row into cache at its slot, in place."""
    _check(cache, k, v, slot_mapping)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, kv_heads, head_dim = cache.shape
    _write_kv_kernel[(num_tokens,)](
        cache,
        k,
        v,
        slot_mapping,
        *cache.stride()[:4],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        KV_HEADS=kv_heads,
        KV_HEADS_PADDED=triton.next_power_of_2(kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
    )


def write_kv_ref(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Pure-torch twin of `write_kv`."""
    _check(cache, k, v, slot_mapping)
    block_size = cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    cache[0, blocks, offsets] = k[keep]
    cache[1, blocks, offsets] = v[keep]
