"""What verification returns to the executor."""

from __future__ import annotations

from typing import NamedTuple

import torch

from specpage.core.step import Cost, SeqResult


class Verdict(NamedTuple):
    results: list[SeqResult]  # per sequence of the batch
    cost: Cost | None  # the target forward's, when it decoded only
    # [positions the target computed, in span order, 3 * hidden]: the
    # residual stream entering the layers a draft head reads; None without one
    features: torch.Tensor | None
