"""What a model asks of an attention backend, and the metadata it passes
along: each backend builds the metadata its own `attend` reads, once per
forward for all layers, from the layout of the forward's spans."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

# One sequence's span: (start, num_new, block_table); the new tokens take
# positions start .. start + num_new - 1.
Span = tuple[int, int, list[int]]


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
    `build_metadata`.
    """

    def build_metadata(
        self, spans: list[Span], block_size: int, groups: int, device: torch.device
    ) -> AttentionMetadata: ...

    def write_kv(
        self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None: ...

    def attend(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor: ...

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: torch.Tensor) -> None: ...


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


def lay_out_spans(spans: list[Span], block_size: int) -> SpanLayout:
    starts = torch.tensor([s for s, _, _ in spans], dtype=torch.int64)
    query_lens = torch.tensor([n for _, n, _ in spans], dtype=torch.int64)
    max_blocks = max(len(t) for _, _, t in spans)
    block_tables = torch.tensor(
        [t + [0] * (max_blocks - len(t)) for _, _, t in spans], dtype=torch.int64
    )
    query_start = torch.nn.functional.pad(query_lens.cumsum(0), (1, 0))
    token_seq = torch.repeat_interleave(torch.arange(len(spans)), query_lens)
    token_pos = starts[token_seq] + torch.arange(len(token_seq)) - query_start[token_seq]
    slot_mapping = (
        block_tables[token_seq, token_pos // block_size] * block_size + token_pos % block_size
    )
    return SpanLayout(
        block_size=block_size,
        starts=starts,
        query_lens=query_lens,
        context_lens=starts + query_lens,
        query_start=query_start,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
    )
