"""The dense linear layer models are built of."""

from __future__ import annotations

import torch
from torch import nn

from specpage.layers.products import PackedWeight, Product, cpu_linear, direct_bf16_product


class Linear(nn.Linear):
    """nn.Linear (same parameters) with the CPU's fastest product for the rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear(x, self.weight, self.bias, self.packed)

    def direct_product(self, rows: int) -> Product | None:
        """The kernel call for x of `rows` bf16 rows (layers/native_stack.py)."""
        return None if self.bias is not None else direct_bf16_product(self.weight, self.packed,
                                                                      rows)
