"""A runner's KV tensors and the attention backend that reads them.

Every runner (a model's, a head's) keeps per layer K and V for every block
of the shared pool, `[2, num_blocks, block_size, kv_heads, head_dim]`,
indexed by the pool's block ids; one allocation holds all its layers. The
backend is chosen here, once, for the device and head_dim, after the native
CPU kernels are built or loaded, so neither happens in a timed forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpage.attention.backend import AttentionBackend, AttentionMetadata
from specpage.attention.selection import select_backend
from specpage.core.span import Span
from specpage.kernels.cpu import hugepages
from specpage.kernels.cpu.native import native_kernels


@dataclass(frozen=True)
class KvShape:
    """What sizes a runner's KV tensors."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


class KvCache:
    def __init__(self, shape: KvShape, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend | None = None, row_invariant: bool = False) -> None:
        if device.type == "cpu":
            native_kernels()  # built (once per machine) or loaded now, not in a timed forward
        self.backend = backend or select_backend(device, shape.head_dim, row_invariant)
        self.block_size = shape.block_size
        self.device = device
        # [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]
        self.tensor = hugepages.zeros(
            (shape.num_layers, 2, shape.num_blocks, shape.block_size, shape.num_kv_heads,
             shape.head_dim), dtype, device)
        self.layers = list(self.tensor.unbind(0))  # one [2, num_blocks, ...] view per layer

    def metadata(self, spans: Sequence[Span], groups: int) -> AttentionMetadata:
        """The backend's metadata for a forward over these spans; groups:
        query heads per KV head."""
        return self.backend.build_metadata(spans, self.block_size, groups, self.device)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: each src block's K/V of every layer into dst."""
        if not copies:
            return
        pairs = torch.tensor(copies, dtype=torch.int64, device=self.device)  # [num_pairs, 2]
        self.backend.copy_blocks(self.tensor, pairs)
