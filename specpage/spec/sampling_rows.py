"""Per-row sampling parameters as tensors, and the seeded uniforms of rows."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from specpage.request import Sequence
from specpage.sampler import Purpose, probabilities, uniform


def row_probabilities(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """logits [rows, vocab], one sequence per row -> probabilities [rows, vocab]."""
    params = [s.request.params for s in seqs]
    return probabilities(
        logits,
        torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_k for p in params], dtype=torch.int64),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
    )


def uniforms(seqs: Seq[Sequence], positions: Seq[int], purpose: Purpose) -> torch.Tensor:
    """[rows] fp64: the draw for each sequence's token at that position."""
    return torch.tensor(
        [uniform(s.seed, p, purpose) for s, p in zip(seqs, positions, strict=True)],
        dtype=torch.float64,
    )
