"""The Triton kernels of `specpage.kernels` behind the attention backend
protocol (the GPU path)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpage.attention.backend import AttentionMetadata, lay_out_spans
from specpage.core.span import Span
from specpage.kernels.triton.block_copy import copy_blocks
from specpage.kernels.triton.kv_write import write_kv
from specpage.kernels.triton.paged_decode import paged_decode, takes_spans
from specpage.kernels.triton.paged_prefill import paged_prefill


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy where its last stride is not 1: the kernels read
    each head's row as one vector. On CUDA the projections' outputs are
    contiguous already; a CPU product's transposed output (the kernels in
    Triton's interpreter) is not."""
    return x if x.stride(-1) == 1 else x.contiguous()


@dataclass(frozen=True)
class TritonMetadata(AttentionMetadata):
    """What the kernels read (`specpage.kernels.PagedSpans`), on the cache's
    device."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [num_seqs] int64, tokens with KV after this forward's writes
    query_start: torch.Tensor  # [num_seqs + 1] int64, first token row of each span (cumsum)
    max_query: int
    max_context: int


class TritonAttention:
    """Writes K/V with `kv_write` and attends with `paged_decode` when every
    span is short (decoding, verification), `paged_prefill` otherwise.

    cache: [2, num_blocks, block_size, kv_heads, head_dim] (K then V) of one layer.
    The kernels have no sliding window: a model whose layers have one is
    refused where its runner is made (attends_windows).
    """

    attends_windows = False

    def build_metadata(
        self, spans: Sequence[Span], block_size: int, groups: int, device: torch.device
    ) -> TritonMetadata:
        """The kernels serve every query head of a group in one program, so groups changes
        nothing here."""
        layout = lay_out_spans(spans, block_size)
        return TritonMetadata(
            slot_mapping=layout.slot_mapping.to(device),
            block_tables=layout.block_tables.to(device),
            context_lens=layout.context_lens.to(device),
            query_start=layout.query_start.to(device),
            max_query=int(layout.query_lens.max()),
            max_context=int(layout.context_lens.max()),
        )

    def write_kv(
        self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        write_kv(cache, _unit_rows(k), _unit_rows(v), meta.slot_mapping)

    def attend(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """q [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]."""
        assert isinstance(meta, TritonMetadata), "metadata from another backend's build_metadata"
        assert window is None, "the Triton kernels have no sliding window"
        num_tokens, groups = q.shape[0], q.shape[1] // cache.shape[3]
        short = takes_spans(meta.max_query, groups) and num_tokens >= meta.context_lens.shape[0]
        attend_spans = paged_decode if short else paged_prefill
        return attend_spans(_unit_rows(q), cache, meta, scale).view(num_tokens, -1)

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        """kv_cache [layers, 2, num_blocks, ...]; pairs [num_pairs, 2] int64 (src, dst)."""
        copy_blocks(kv_cache, pairs)
