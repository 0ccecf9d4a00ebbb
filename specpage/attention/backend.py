"""What a model asks of an attention backend, and the metadata it passes
along: each backend builds the metadata its own `attend` reads, once per
forward for all layers, from the layout of the forward's spans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specpage.core.span import Span


@dataclass(frozen=True)
class AttentionMetadata:
    """What every backend reads: where each new token's K/V goes. A
    backend's `build_metadata` returns a subclass with what its `attend`
    reads besides, and nothing more."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot (block * block_size + offset)


class AttentionBackend(Protocol):
    """Writes a forward's new K/V into one layer's cache and attends over it.

    cache: [2, num_blocks, block_size, kv_heads, head_dim] (K then V) of one
    layer. `write_kv` and `attend` take metadata from this backend's own
    `build_metadata`. A layer with a window passes it to `attend`: a query
    at position p then sees the keys at p - window + 1 .. p (transformers'
    sliding-window mask); a backend with `attends_windows` False refuses it.
    """

    attends_windows: bool

    def build_metadata(
        self, spans: Sequence[Span], block_size: int, groups: int, device: torch.device
    ) -> AttentionMetadata: ...

    def write_kv(
        self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None: ...

    def attend(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int | None = None,
    ) -> torch.Tensor: ...

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: torch.Tensor) -> None: ...


def _int64(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@dataclass(frozen=True)
class SpanLayout:
    """A forward's spans as CPU tensors: what each backend's metadata is
    built from."""

    block_size: int
    starts: torch.Tensor  # [num_seqs] int64, position of each span's first token
    query_lens: torch.Tensor  # [num_seqs] int64, new tokens per sequence
    context_lens: torch.Tensor  # [num_seqs] int64, tokens with KV after this forward's writes
    query_start: torch.Tensor  # [num_seqs + 1] int64, first token row of each span (cumsum)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot of each new token


def _slots(table: Sequence[int], start: int, n: int, block_size: int) -> list[int]:
    """The flat slots of positions start..start + n under a block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


def group_tables(spans: Sequence[Span], block_size: int,
                 count: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Layer groups 1..count - 1's slot mappings and block tables (group 0's
    are lay_out_spans'), as the native layer stack reads them: each group's
    a row of one tensor, so that the six groups of a Gemma 3 forward cost
    two tensors instead of a SpanLayout each (0.2 ms of its ~10 ms step)."""
    if count <= 1:
        return [], []
    groups = range(count - 1)
    width = max(len(s.group_tables[g]) for s in spans for g in groups)
    slots = [[slot for s in spans
              for slot in _slots(s.group_tables[g], s.start, len(s.token_ids), block_size)]
             for g in groups]
    tables = [[[*s.group_tables[g], *[0] * (width - len(s.group_tables[g]))] for s in spans]
              for g in groups]
    return list(_int64(slots).unbind(0)), list(_int64(tables).unbind(0))


def lay_out_spans(spans: Sequence[Span], block_size: int) -> SpanLayout:
    """The spans' positions and block tables; only their lengths are read of
    their tokens."""
    # Python lists, one tensor each at the end: a decode step's few spans
    # cost a handful of microseconds this way, against ~70 for torch ops.
    starts = [s.start for s in spans]
    query_lens = [len(s.token_ids) for s in spans]
    max_blocks = max(len(s.block_table) for s in spans)
    query_start = [0]
    slots: list[int] = []
    for start, n, s in zip(starts, query_lens, spans, strict=True):
        table = s.block_table
        query_start.append(query_start[-1] + n)
        slots.extend(_slots(table, start, n, block_size))
    return SpanLayout(
        block_size=block_size,
        starts=_int64(starts),
        query_lens=_int64(query_lens),
        context_lens=_int64([start + n for start, n in zip(starts, query_lens, strict=True)]),
        query_start=_int64(query_start),
        block_tables=_int64([[*s.block_table, *[0] * (max_blocks - len(s.block_table))]
                             for s in spans]),
        slot_mapping=_int64(slots),
    )
