"""Per-row sampling parameters as tensors, and the seeded uniforms of rows."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from specpage.core.step import Sampling
from specpage.speculation.sampler import Purpose, probabilities, uniform


def row_probabilities(logits: torch.Tensor, rows: Seq[Sampling]) -> torch.Tensor:
    """logits [rows, vocab], one sample's parameters per row -> probabilities [rows, vocab]."""
    return probabilities(
        logits,
        torch.tensor([r.temperature for r in rows], dtype=torch.float32),
        torch.tensor([r.top_k for r in rows], dtype=torch.int64),
        torch.tensor([r.top_p for r in rows], dtype=torch.float32),
    )


def uniforms(rows: Seq[Sampling], positions: Seq[int], purpose: Purpose) -> torch.Tensor:
    """[rows] fp64: the draw for each sample's token at that position."""
    return torch.tensor(
        [uniform(r.seed, p, purpose) for r, p in zip(rows, positions, strict=True)],
        dtype=torch.float64,
    )
