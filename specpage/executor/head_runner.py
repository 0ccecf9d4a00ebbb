"""An EAGLE-3 head's runner: its one layer's KV tensor, indexed by the
shared pool's block ids like a one-layer draft model's, and its forwards.

The head reads the target's token embedding (a head stores none of its
own, unless its checkpoint does) and, per position, a hidden state: the
target's features projected by `fc`, or its own previous output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specpage.attention.backend import AttentionBackend
from specpage.core.span import Span
from specpage.executor.kv_cache import KvCache, KvShape
from specpage.models.eagle3 import LoadedHead


class HeadRunner:
    def __init__(self, head: LoadedHead, target_embedding: nn.Embedding, num_blocks: int,
                 block_size: int, backend: AttentionBackend | None = None) -> None:
        self.model = head.model
        self.config = head.config.layer
        self.hidden_size = self.config.hidden_size
        self.tap_width = head.model.fc.in_features  # a position's tapped states, concatenated
        self.embedding = head.model.embed_tokens or target_embedding
        self.block_size = block_size
        self.group_count = 1  # one table a span: the pool's (core/layer_groups.py)
        self.device, self.dtype = head.model.norm.weight.device, head.dtype
        c = self.config
        self.kv = KvCache(KvShape(1, num_blocks, block_size, c.num_kv_heads, c.head_dim),
                          self.dtype, self.device, backend)
        self.groups = c.num_heads // c.num_kv_heads  # query heads per KV head

    @torch.inference_mode()
    def features(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's tapped states [n, 3 * target_hidden] -> [n, hidden]."""
        return self.model.fc(taps.to(self.dtype))

    @torch.inference_mode()
    def run(self, spans: Sequence[Span], hidden: torch.Tensor,
            every_output: bool = False) -> torch.Tensor:
        """The layer over the spans, whose token_ids are each position's
        NEXT token (what the head embeds), with one hidden state per
        position [n, hidden]; writes its K/V at every position, returns its
        pre-norm output at each span's last position [len(spans), hidden]
        (every_output: at every position, [n, hidden]).

        Only a span's last output is ever read (the state a proposal starts
        from), so the other positions stop at their K/V: attention, o_proj
        and the MLP run for one row a span. An absorb over the positions a
        sequence left while it did not speculate, up to a block of them,
        costs the qkv projection and little more."""
        meta = self.kv.metadata(spans, self.groups)
        outputs = None
        if not every_output and any(len(s.token_ids) > 1 for s in spans):
            ends = torch.tensor([len(s.token_ids) for s in spans]).cumsum(0) - 1
            last = self.kv.metadata([Span(s.token_ids[-1:], s.end - 1, s.block_table)
                                     for s in spans], self.groups)
            outputs = (ends.to(self.device), last)
        ids = torch.tensor([t for s in spans for t in s.token_ids], dtype=torch.int64)
        positions = torch.cat([torch.arange(s.start, s.end) for s in spans])
        return self.model(self.embedding(ids.to(self.device)), hidden.to(self.dtype),
                          positions.to(self.device), self.kv.layers[0], meta,
                          self.kv.backend, outputs)

    @torch.inference_mode()
    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> fp32 [rows, target vocab], -inf outside the draft vocabulary."""
        return self.model.logits(prenorm.to(self.dtype))

    def forward(self, spans: Sequence[Span]) -> torch.Tensor:
        """A proposal-like forward (zero features, logits at each span's
        last num_logits positions), for timing the head at start-up
        (speculation/calibrate.py)."""
        rows = sum(len(s.token_ids) for s in spans)
        every = any(s.num_logits > 1 for s in spans)
        out = self.run(spans, torch.zeros(rows, self.config.hidden_size, dtype=self.dtype,
                                          device=self.device), every_output=every)
        if not every:  # each span's last output
            return self.logits(out)
        ends = torch.tensor([len(s.token_ids) for s in spans]).cumsum(0).tolist()
        index = [i for s, e in zip(spans, ends, strict=True) for i in range(e - s.num_logits, e)]
        return self.logits(out[index])

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: the head's K/V of each src block into dst."""
        self.kv.copy_blocks(copies)
