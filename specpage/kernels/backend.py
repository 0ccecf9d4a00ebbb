"""The Triton kernels behind the `specpage.attention` backend protocol (the
GPU path)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specpage.kernels.block_copy import copy_blocks
from specpage.kernels.kv_write import write_kv
from specpage.kernels.paged_decode import paged_decode
from specpage.kernels.paged_prefill import paged_prefill

if TYPE_CHECKING:
    # Annotations only, so specpage.attention can import this module.
    from specpage.attention import AttentionMetadata


class TritonAttention:
    """Writes K/V with `kv_write` and attends with `paged_decode` when every
    sequence brings one token, `paged_prefill` otherwise.

    cache: [2, num_blocks, block_size, kv_heads, head_dim] (K then V) of one layer.
    """

    def write_kv(
        self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        write_kv(cache, k, v, meta.slot_mapping)

    def attend(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]."""
        num_tokens = q.shape[0]
        # max_query == 1 alone would admit sequences with no new token.
        one_token_each = meta.max_query == 1 and num_tokens == meta.context_lens.shape[0]
        attend_spans = paged_decode if one_token_each else paged_prefill
        return attend_spans(q, cache, meta, scale).view(num_tokens, -1)

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        """kv_cache [layers, 2, num_blocks, ...]; pairs [num_pairs, 2] int64 (src, dst)."""
        copy_blocks(kv_cache, pairs)
