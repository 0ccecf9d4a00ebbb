"""A span: one sequence's new tokens in one forward of one model.

A prefill chunk, one decode token, a draft catching up, or the k + 1
positions the target verifies; spans of every kind mix in one forward. The
same value goes from the speculation layer to a runner, to the attention
backends' metadata and, under tensor parallelism, over the wire to the
other ranks (msgspec encodes it as a short array).
"""

from __future__ import annotations

import msgspec


class Span(msgspec.Struct, frozen=True, array_like=True):
    token_ids: list[int]  # new tokens, at positions start .. start + len - 1
    start: int  # positions before it already have KV in this model
    block_table: list[int]  # covers at least start + len positions
    num_logits: int = 1  # logits for the last num_logits tokens of the span

    @property
    def end(self) -> int:
        """Positions with KV once the span is written."""
        return self.start + len(self.token_ids)
