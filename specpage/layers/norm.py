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

    def kernel_weight(self) -> torch.Tensor:
        """What the norm kernels multiply by: the weight."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def after_add(self, x: torch.Tensor,
                  residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, that sum normed)."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm, as transformers computes it: normed and scaled by
    (1 + weight) in fp32, then cast to x's dtype (Llama's casts before the
    weight). The weight is stored as the offset from 1."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def kernel_weight(self) -> torch.Tensor:
        """What the norm kernels multiply by: (1 + weight) in float32."""
        return 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.scaled_rms_norm(x, self.kernel_weight(), self.eps)

    def after_add(self, x: torch.Tensor,
                  residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, that sum normed)."""
        return fused.scaled_add_rms_norm(x, residual, self.kernel_weight(), self.eps)
