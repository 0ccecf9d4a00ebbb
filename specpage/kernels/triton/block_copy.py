"""Copy-on-write: copy whole blocks (K and V of every layer) from src to dst.

One program per (pair, layer, K or V) copies one block, which is contiguous
because the last three cache dims are. Destinations must be distinct and
must not be a source in the same call (a fresh block per copy, as COW
allocates); the pairs are not checked for that, since it would cost a
device-to-host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specpage.kernels.triton import (
    FLOAT_DTYPES,
    check_device,
    check_head_dim,
    check_tensor,
    require,
)

__all__ = ["copy_blocks", "copy_blocks_ref"]

CHUNK = 1024  # elements per loop iteration


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    pairs_ptr,  # [num_pairs, 2] int64 (src, dst)
    stride_layer,
    stride_kv,
    stride_block,
    BLOCK_NUMEL: tl.constexpr,  # block_size * kv_heads * head_dim
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    kv = tl.program_id(2).to(tl.int64)
    src = tl.load(pairs_ptr + 2 * pair)  # int64: block * stride_block can pass 2**31
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    base = layer * stride_layer + kv * stride_kv
    src_ptr = cache_ptr + base + src * stride_block
    dst_ptr = cache_ptr + base + dst * stride_block
    for chunk_start in range(0, BLOCK_NUMEL, CHUNK):
        offsets = chunk_start + tl.arange(0, CHUNK)
        mask = offsets < BLOCK_NUMEL
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def _check(cache: torch.Tensor, pairs: torch.Tensor) -> None:
    check_tensor("cache", cache, 6, FLOAT_DTYPES)
    require(
        cache.shape[1] == 2,
        f"cache must be [layers, 2, num_blocks, block_size, kv_heads, head_dim], "
        f"got {list(cache.shape)}",
    )
    check_head_dim(cache.shape[5])
    block_size, kv_heads, head_dim = cache.shape[3:]
    require(
        cache.stride()[3:] == (kv_heads * head_dim, head_dim, 1),
        f"cache blocks must be contiguous (last three dims), got strides {cache.stride()}",
    )
    check_tensor("pairs", pairs, 2, (torch.int64,))
    require(pairs.shape[1] == 2, f"pairs must be [num_pairs, 2], got {list(pairs.shape)}")
    require(pairs.is_contiguous(), "pairs must be contiguous")
    check_device(cache, pairs=pairs)


def copy_blocks(
    cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    pairs: torch.Tensor,  # [num_pairs, 2] int64 (src, dst) block ids
) -> None:
    """For every pair, copy block src into block dst in every layer, K and V, in place."""
    _check(cache, pairs)
    num_pairs, layers = pairs.shape[0], cache.shape[0]
    if num_pairs == 0 or layers == 0:
        return
    block_size, kv_heads, head_dim = cache.shape[3:]
    _copy_blocks_kernel[(num_pairs, layers, 2)](
        cache,
        pairs,
        *cache.stride()[:3],
        BLOCK_NUMEL=block_size * kv_heads * head_dim,
        CHUNK=CHUNK,
    )


def copy_blocks_ref(cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Pure-torch twin of `copy_blocks`."""
    _check(cache, pairs)
    cache[:, :, pairs[:, 1]] = cache[:, :, pairs[:, 0]]
