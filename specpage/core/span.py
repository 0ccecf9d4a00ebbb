"""A span: one sequence's new tokens in one forward of one model.

A prefill chunk, one decode token, a draft catching up, or the k + 1
positions the target verifies; spans of every kind mix in one forward. The
same value goes from the speculation layer to a runner, to the attention
backends' metadata and, under tensor parallelism, over the wire to the
other ranks (msgspec encodes it as a short array).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class Span(msgspec.Struct, frozen=True, array_like=True):
    token_ids: list[int]  # new tokens, at positions start .. start + len - 1
    start: int  # positions before it already have KV in this model
    block_table: list[int]  # covers at least start + len positions
    num_logits: int = 1  # logits for the last num_logits tokens of the span
    # a runner whose layers keep KV in groups (core/layer_groups.py): the
    # tables of its groups after the first (block_table); else none
    group_tables: list[list[int]] = []

    @property
    def end(self) -> int:
        """Positions with KV once the span is written."""
        return self.start + len(self.token_ids)


def group_spans(spans: Sequence[Span], group: int) -> list[Span]:
    """The spans with a layer group's tables as their block tables (group 0:
    as they are)."""
    if group == 0:
        return list(spans)
    return [msgspec.structs.replace(s, block_table=s.group_tables[group - 1]) for s in spans]
