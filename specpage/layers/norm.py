"""RMSNorm, alone or after the residual add, on the fused kernels where they apply."""

from __future__ import annotations

import torch
from torch import nn

from specpage.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def after_add(self, x: torch.Tensor,
                  residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, that sum normed)."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)
