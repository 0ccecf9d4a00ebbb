"""The pure-torch reference attention backend (the CPU path): each
sequence's context is gathered through its block table, and SDPA runs over
sequences padded together in groups of similar span length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specpage.attention.backend import AttentionMetadata, SpanLayout, lay_out_spans
from specpage.core.arith import cdiv
from specpage.core.span import Span


@dataclass(frozen=True)
class TorchMetadata(AttentionMetadata):
    """What `TorchAttention.attend` reads besides the slots: padded views,
    built once per forward for all layers."""

    padded: list[PaddedGroup]  # sequences with spans of similar length, padded together


@dataclass(frozen=True)
class PaddedGroup:
    """Sequences whose spans the reference backend pads to one query length
    and one context. Prefill chunks and decode tokens go in different groups,
    so one long chunk does not pad every decode row to its length."""

    token_rows: torch.Tensor | None  # [tokens] rows of q in this group; None: all, in order
    num_seqs: int
    max_query: int
    max_context: int
    gather_blocks: torch.Tensor  # [num_seqs * ceil(max_context / block_size)] int64, block ids
    mask: torch.Tensor | None  # [num_seqs, 1, groups * max_query, max_context] bool, True = attend
    query_index: torch.Tensor | None  # [tokens] row of each token in [num_seqs * max_query]
    query_pos: torch.Tensor  # [num_seqs, max_query] int64 position of each row; padding: 0
    groups: int
    # window -> its mask, made by the first layer with that window and
    # read by the others of the forward
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_within(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer that sees `window` keys back (None: all)."""
        if window is None or window >= self.max_context:
            return self.mask  # no query reaches back past the window
        if window not in self.windowed:
            self.windowed[window] = _visible(self.query_pos, self.max_context, self.groups,
                                             window)
        return self.windowed[window]


class TorchAttention:
    """Gathers each sequence's context through its block table and runs SDPA.

    cache: [2, num_blocks, block_size, kv_heads, head_dim] (K then V) of one layer.
    """

    attends_windows = True

    def __init__(self) -> None:
        # Gather destinations, reused across layers and steps: a fresh tensor
        # of tens of MB per gather costs more in page faults than the copy.
        self._workspace: list[torch.Tensor | None] = [None, None]

    def _gather(self, rows: torch.Tensor, blocks: torch.Tensor, which: int) -> torch.Tensor:
        size = blocks.numel() * rows.shape[1]
        buffer = self._workspace[which]
        if (buffer is None or buffer.numel() < size or buffer.dtype != rows.dtype
                or buffer.device != rows.device):
            buffer = self._workspace[which] = rows.new_empty(size + size // 4)
        out = buffer[:size].view(blocks.numel(), rows.shape[1])
        return torch.index_select(rows, 0, blocks, out=out)

    def build_metadata(
        self, spans: Sequence[Span], block_size: int, groups: int, device: torch.device
    ) -> TorchMetadata:
        """groups: query heads per KV head, stacked along the query axis of each mask."""
        layout = lay_out_spans(spans, block_size)
        grouped = _group_by_span([len(s.token_ids) for s in spans])
        padded = [
            _padded_group(members, layout, groups, len(grouped) == 1, device)
            for members in grouped
        ]
        return TorchMetadata(slot_mapping=layout.slot_mapping.to(device), padded=padded)

    def write_kv(
        self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        kv_heads, head_dim = cache.shape[-2:]
        flat = cache.view(2, -1, kv_heads, head_dim)
        flat[0].index_copy_(0, meta.slot_mapping, k)
        flat[1].index_copy_(0, meta.slot_mapping, v)

    def attend(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """q [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]."""
        assert isinstance(meta, TorchMetadata), "metadata from another backend's build_metadata"
        if len(meta.padded) == 1:
            return self._attend_group(q, cache, meta.padded[0], scale, window)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        self._attend_groups_into(out, q, cache, meta.padded, scale, window)
        return out

    def _attend_groups_into(self, out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor,
                            groups: list[PaddedGroup], scale: float, window: int | None) -> None:
        """Attend each group's rows of q and write them to the same rows of out."""
        for group in groups:
            assert group.token_rows is not None
            rows = group.token_rows
            out.index_copy_(0, rows, self._attend_group(q[rows], cache, group, scale, window))

    def _attend_group(
        self, q: torch.Tensor, cache: torch.Tensor, group: PaddedGroup, scale: float,
        window: int | None,
    ) -> torch.Tensor:
        _, heads, head_dim = q.shape
        kv_heads = cache.shape[-2]
        groups = heads // kv_heads
        num_seqs, max_query = group.num_seqs, group.max_query
        if group.query_index is not None:
            padded = q.new_zeros(num_seqs * max_query, heads, head_dim)
            q = padded.index_copy_(0, group.query_index, q)
        # Query heads sharing a KV head are stacked along the query axis, so
        # K and V are gathered once per KV head rather than repeated.
        q = q.view(num_seqs, max_query, kv_heads, groups, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, kv_heads, groups * max_query, head_dim)
        # Whole blocks are gathered (one contiguous row of block_size * kv_heads
        # * head_dim each, far cheaper than a row per position), then cut to
        # max_context by a view; positions past a sequence's context are masked.
        rows = cache.view(2, cache.shape[1], -1)
        shape = (num_seqs, -1, kv_heads, head_dim)
        context = group.max_context
        k = self._gather(rows[0], group.gather_blocks, 0).view(shape)[:, :context].transpose(1, 2)
        v = self._gather(rows[1], group.gather_blocks, 1).view(shape)[:, :context].transpose(1, 2)
        mask = group.mask_within(window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out = out.view(num_seqs, kv_heads, groups, max_query, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(num_seqs * max_query, heads * head_dim)
        return out if group.query_index is None else out[group.query_index]

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        """kv_cache [layers, 2, num_blocks, ...]; pairs [num_pairs, 2] int64 (src, dst)."""
        kv_cache[:, :, pairs[:, 1]] = kv_cache[:, :, pairs[:, 0]]


SHORT_SPAN = 8  # decode tokens and verify spans share a group up to this length


def _group_by_span(query_lens: list[int]) -> list[list[int]]:
    """Sequence indices grouped by span length: all short spans together,
    longer ones by power of two, so padding at most doubles a group's work."""
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(query_lens):
        key = 0 if n <= SHORT_SPAN else (n - 1).bit_length()
        buckets.setdefault(key, []).append(i)
    return [buckets[key] for key in sorted(buckets)]


def _padded_group(
    members: list[int], layout: SpanLayout, groups: int, only_group: bool, device: torch.device
) -> PaddedGroup:
    index = torch.tensor(members, dtype=torch.int64)
    starts, query_lens = layout.starts[index], layout.query_lens[index]
    block_size = layout.block_size
    context_lens = starts + query_lens
    num_seqs = len(members)
    max_query, max_context = int(query_lens.max()), int(context_lens.max())
    context_blocks = cdiv(max_context, block_size)
    # padding entries read block 0, masked below
    gather_blocks = layout.block_tables[index, :context_blocks].reshape(-1)
    query_pos = starts[:, None] + torch.arange(max_query)[None, :]  # [num_seqs, max_query]
    valid_query = torch.arange(max_query)[None, :] < query_lens[:, None]
    # Padded query rows sit at position 0, so they see position 0 alone
    # (within any window) and no row is empty (NaN).
    query_pos = query_pos.masked_fill(~valid_query, 0).to(device)
    mask = _visible(query_pos, max_context, groups, None)
    # One token per sequence over full, equal contexts: nothing to hide.
    needs_mask = max_query > 1 or not bool((context_lens == max_context).all())
    seq_of_row = torch.arange(num_seqs)[:, None].expand(num_seqs, max_query)
    rows = (seq_of_row * max_query + torch.arange(max_query)[None, :])[valid_query]
    query_index = None if bool(valid_query.all()) else rows
    token_rows = None
    if not only_group:
        offsets = torch.arange(max_query)[None, :].expand(num_seqs, max_query)
        token_rows = (layout.query_start[index][:, None] + offsets)[valid_query].to(device)
    return PaddedGroup(
        token_rows=token_rows,
        num_seqs=num_seqs,
        max_query=max_query,
        max_context=max_context,
        gather_blocks=gather_blocks.to(device),
        mask=mask if needs_mask else None,
        query_index=None if query_index is None else query_index.to(device),
        query_pos=query_pos,
        groups=groups,
    )


def _visible(query_pos: torch.Tensor, max_context: int, groups: int, window: int | None
             ) -> torch.Tensor:
    """[num_seqs, 1, groups * max_query, max_context] bool: the keys each
    query row sees, causal and, given a window, the window's last keys only."""
    num_seqs = query_pos.shape[0]
    positions = torch.arange(max_context, device=query_pos.device)[None, None, :]
    mask = positions <= query_pos[:, :, None]
    if window is not None:
        mask &= positions > query_pos[:, :, None] - window
    return mask[:, None].repeat(1, groups, 1, 1).view(num_seqs, 1, -1, max_context)
