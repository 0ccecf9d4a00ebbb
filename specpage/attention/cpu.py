"""The CPU backend: spans of up to NATIVE_SPAN tokens (decode tokens, verify
spans, a draft catching up, short prefill chunks) attend through the native
kernel (specpage/kernels/cpu/paged_attention.cpp), which reads each
sequence's K/V blocks in place; longer prefill chunks, and everything where
the kernel could not be built, gather blocks as the reference does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpage.attention.backend import AttentionMetadata, lay_out_spans
from specpage.attention.native import NATIVE_HEAD_DIMS, NO_WINDOW, native_kernels
from specpage.attention.reference import (
    TorchAttention,
    TorchMetadata,
    _group_by_span,
    _padded_group,
)
from specpage.core.span import Span

# The longest span the native kernel attends. It scores each row against the
# whole context (causality by a count, not by skipping work) and makes none
# of the reference's padded copies, which up to here is the faster trade
# (docs/BENCHMARKS.md, "Native attention span"; tests/attention/
# test_cpu_attention.py checks its outputs against the reference at these
# lengths). Longer prefill chunks stay on the reference, whose attention
# skips the masked half.
NATIVE_SPAN = 64


@dataclass(frozen=True)
class ShortSpans:
    """The forward's spans of at most NATIVE_SPAN tokens, as the kernel reads them."""

    token_rows: torch.Tensor | None  # [tokens] rows of q; None: all, in order
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    query_start: torch.Tensor  # [num_seqs + 1] int64, first row of each span in q[token_rows]
    context_lens: torch.Tensor  # [num_seqs] int64, KV after this forward's writes


@dataclass(frozen=True)
class CpuMetadata(TorchMetadata):
    """The reference's metadata (its padded groups hold the longer spans only)
    and the short spans the kernel reads."""

    short: ShortSpans | None


class CpuAttention(TorchAttention):
    """TorchAttention with short spans on the native kernel. Select it only
    where `native_kernels()` is not None and the head_dim is in NATIVE_HEAD_DIMS.

    every_span: every span on the kernel, however long (engine.deterministic).
    The kernel computes each query row from that row's q and the K/V it sees,
    in an order that depends on neither the span nor the rest of the context
    (positions it does not see add exact zeros), so a position's output is the
    same whether it is decoded, verified or prefilled, in any chunk; the
    reference's padded batches are not (they sum in SDPA's blocks)."""

    def __init__(self, every_span: bool = False) -> None:
        super().__init__()
        kernels = native_kernels()
        assert kernels is not None, "CpuAttention needs the native kernel"
        self._kernel = kernels.paged_attention
        self.native_span = None if every_span else NATIVE_SPAN

    def build_metadata(
        self, spans: Sequence[Span], block_size: int, groups: int, device: torch.device
    ) -> CpuMetadata:
        layout = lay_out_spans(spans, block_size)
        query_lens = [len(s.token_ids) for s in spans]
        limit = self.native_span
        short_members = [i for i, n in enumerate(query_lens) if limit is None or n <= limit]
        long = [i for i, n in enumerate(query_lens) if limit is not None and n > limit]
        rest = [[long[j] for j in members]
                for members in _group_by_span([query_lens[i] for i in long])]
        short = None
        if len(short_members) == len(spans):  # every span short: the layout as it is
            short = ShortSpans(token_rows=None, block_tables=layout.block_tables,
                               query_start=layout.query_start, context_lens=layout.context_lens)
        elif short_members:
            index = torch.tensor(short_members, dtype=torch.int64)
            token_rows = torch.cat([
                torch.arange(int(layout.query_start[i]), int(layout.query_start[i + 1]))
                for i in short_members
            ])
            short = ShortSpans(
                token_rows=token_rows,
                block_tables=layout.block_tables[index].contiguous(),
                query_start=torch.nn.functional.pad(layout.query_lens[index].cumsum(0), (1, 0)),
                context_lens=layout.context_lens[index].contiguous(),
            )
        padded = [_padded_group(members, layout, groups, not short and len(rest) == 1, device)
                  for members in rest]
        return CpuMetadata(slot_mapping=layout.slot_mapping.to(device), padded=padded,
                           short=short)

    def attend(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """q [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]."""
        assert isinstance(meta, CpuMetadata), "metadata from another backend's build_metadata"
        short = meta.short
        if short is not None and short.token_rows is None:
            return self._short(q, cache, short, scale, window)
        if short is None and len(meta.padded) == 1:
            return self._attend_group(q, cache, meta.padded[0], scale, window)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        if short is not None:
            assert short.token_rows is not None
            rows = short.token_rows
            out.index_copy_(0, rows, self._short(q[rows], cache, short, scale, window))
        self._attend_groups_into(out, q, cache, meta.padded, scale, window)
        return out

    def all_short(self, meta: AttentionMetadata) -> ShortSpans | None:
        """The kernel's operands where every span of the forward is short
        (attend then makes one kernel call), else None."""
        assert isinstance(meta, CpuMetadata), "metadata from another backend's build_metadata"
        short = meta.short
        return short if short is not None and short.token_rows is None else None

    def _short(
        self, q: torch.Tensor, cache: torch.Tensor, short: ShortSpans, scale: float,
        window: int | None,
    ) -> torch.Tensor:
        out: torch.Tensor = self._kernel(q.contiguous(), cache, short.block_tables,
                                         short.query_start, short.context_lens, scale,
                                         window or NO_WINDOW)
        return out


def cpu_backend_fits(head_dim: int) -> bool:
    return head_dim in NATIVE_HEAD_DIMS and native_kernels() is not None
