"""The modules a shard swaps into a DecoderModel.

The projections that read a rank's slice of the heads (o_proj) or of the
intermediate features (down_proj) produce a partial sum of the full
output: `RowParallel` all-reduces it. The vocabulary is split in row ranges
of embed_tokens (and lm_head): `VocabParallelEmbedding` looks up the tokens
in this rank's range and all-reduces, and `ShardedDecoderModel` gathers the
ranges' logits on rank 0, where sampling runs. The wrappers leave the
wrapped module in place, so a pass that swaps projection modules after
loading (quantization) swaps the inner one and keeps the all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specpage.executor.parallel.comm import Collectives
from specpage.models.config import ModelConfig
from specpage.models.decoder import DecoderModel
from specpage.models.layer import DecoderLayer


class RowParallel(nn.Module):
    """A projection over this rank's input columns, summed over ranks; its
    bias, if any, added once, after the sum."""

    def __init__(self, linear: nn.Module, collectives: Collectives) -> None:
        super().__init__()
        self.bias: torch.Tensor | None = getattr(linear, "bias", None)  # [out]
        linear.register_parameter("bias", None)
        self.linear = linear
        self.collectives = collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.collectives.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows first .. first + rows - 1 of the embedding; other tokens look up
    zeros here and their vectors arrive from the ranks that hold them."""

    def __init__(self, rows: int, hidden: int, collectives: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))  # [rows, hidden]
        self.first = collectives.rank * rows
        self.collectives = collectives

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first  # [num_tokens]
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [num_tokens, hidden]
        return self.collectives.all_reduce(x.masked_fill_(outside[:, None], 0))


class ShardedDecoderModel(DecoderModel):
    """One rank's DecoderModel: config holds this rank's heads and
    intermediate size and the whole vocabulary; embed_tokens (and lm_head)
    hold this rank's vocabulary rows, so the inherited projection scores
    them, and forward gathers every rank's scores on rank 0."""

    def __init__(self, config: ModelConfig, collectives: Collectives) -> None:
        super().__init__(config)
        rows = config.vocab_size // collectives.world
        self.embed_tokens = VocabParallelEmbedding(rows, config.hidden_size, collectives)  # type: ignore[assignment]
        if self.lm_head is not None:
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        self.collectives = collectives

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """DecoderModel.forward's; rank 0: logits [num_logits, vocab],
        other ranks: their columns."""
        return self.collectives.gather_columns(super().forward(*args, **kwargs))

    def restrict_output_vocab(self, token_ids: torch.Tensor | None) -> None:
        if token_ids is not None:
            raise ValueError("a model split over ranks scores its whole vocabulary")
        super().restrict_output_vocab(None)

    def wrap_row_parallel(self) -> None:
        """Sum o_proj's and down_proj's partial outputs over ranks; after the
        weights are loaded (the wrappers' parameter names differ)."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.o_proj = RowParallel(layer.o_proj, self.collectives)  # type: ignore[assignment]
            layer.down_proj = RowParallel(layer.down_proj, self.collectives)  # type: ignore[assignment]
