"""A runner's KV tensors and the attention backend that reads them.

Every runner (a model's, a head's) keeps per layer K and V for every block
of the shared pool, `[2, num_blocks, block_size, kv_heads, head_dim]`,
indexed by the pool's block ids; one allocation holds all its layers. A
model whose layers keep KV in groups (core/layer_groups.py) holds one
group's layers a block, each group read through its own block tables. The
backend is chosen here, once, for the device and head_dim, after the native
CPU kernels are built or loaded, so neither happens in a timed forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpage.attention.backend import AttentionBackend, AttentionMetadata
from specpage.attention.selection import select_backend
from specpage.core.layer_groups import LayerGroups
from specpage.core.span import Span, group_spans
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
    groups: LayerGroups | None = None  # None: one block holds every layer


class KvCache:
    def __init__(self, shape: KvShape, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend | None = None, row_invariant: bool = False) -> None:
        if device.type == "cpu":
            native_kernels()  # built (once per machine) or loaded now, not in a timed forward
        self.backend = backend or select_backend(device, shape.head_dim, row_invariant)
        self.block_size = shape.block_size
        self.device = device
        self.groups = shape.groups
        # [layers a block holds, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]
        self.tensor = hugepages.zeros(
            (shape.num_layers if shape.groups is None else shape.groups.size, 2,
             shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim),
            dtype, device)
        # one [2, num_blocks, ...] view per layer, and the group whose tables it reads
        places = ([(0, layer) for layer in range(shape.num_layers)] if shape.groups is None
                  else [shape.groups.place(layer) for layer in range(shape.num_layers)])
        views = self.tensor.unbind(0)
        self.layers = [views[index] for _, index in places]
        self.layer_groups = [group for group, _ in places]

    def metadata(self, spans: Sequence[Span], groups: int) -> AttentionMetadata:
        """The backend's metadata for a forward over these spans; groups:
        query heads per KV head. A grouped cache's first group's."""
        return self.backend.build_metadata(spans, self.block_size, groups, self.device)

    def layer_metadata(self, spans: Sequence[Span], groups: int) -> list[AttentionMetadata]:
        """Each layer's metadata (a grouped cache's layers read their own
        group's tables); one object for every layer of an ungrouped one."""
        first = self.metadata(spans, groups)
        if self.groups is None:
            return [first] * len(self.layers)
        metas = [first] + [self.metadata(group_spans(spans, g), groups)
                           for g in range(1, len(self.groups.windows))]
        return [metas[g] for g in self.layer_groups]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: each src block's K/V of every layer into dst."""
        if not copies:
            return
        pairs = torch.tensor(copies, dtype=torch.int64, device=self.device)  # [num_pairs, 2]
        self.backend.copy_blocks(self.tensor, pairs)

