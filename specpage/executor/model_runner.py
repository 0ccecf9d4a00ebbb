"""One ModelRunner per model: its KV tensors, indexed by the shared pool's
block ids, and a forward over a flattened batch of spans.

A span is one sequence's new tokens in this forward: a prefill chunk, one
decode token, or the k + 1 positions the target verifies. Spans of every kind
mix in one call; each asks for logits at its last ``num_logits`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpage.attention.backend import AttentionBackend
from specpage.attention.selection import select_backend
from specpage.kernels.cpu import hugepages
from specpage.kernels.cpu.native import native_kernels
from specpage.models.decoder import DecoderModel, LayerTap
from specpage.models.loader import LoadedModel
from specpage.models.native_step import NativeStep


@dataclass(frozen=True)
class SeqSpan:
    token_ids: Sequence[int]  # new tokens, at positions start .. start + len - 1
    start: int  # positions before it already have KV in this model
    block_table: Sequence[int]  # covers at least start + len positions
    num_logits: int = 1  # logits for the last num_logits tokens of the span

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        backend: AttentionBackend | None = None,
    ) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.block_size = block_size
        weight = self.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        if self.device.type == "cpu":
            native_kernels()  # built (once per machine) or loaded now, not in a timed forward
        self.backend = backend or select_backend(self.device, self.config.head_dim)
        c = self.config
        # [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]
        self.kv_cache = hugepages.zeros(
            (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim),
            self.dtype, self.device,
        )
        self.layer_caches = list(self.kv_cache.unbind(0))
        # the step from spans for a DecoderModel's own forward (a subclass's,
        # such as a tensor-parallel shard's, takes the module path)
        self.native_step = (NativeStep.of(self.model, self.backend, self.layer_caches, block_size)
                            if type(self.model).forward is DecoderModel.forward else None)

    @staticmethod
    def bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
        c = loaded.config
        element = loaded.model.embed_tokens.weight.element_size()
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * element

    @torch.inference_mode()
    def forward(self, spans: Sequence[SeqSpan], tap: LayerTap | None = None) -> torch.Tensor:
        """Writes every span's K/V into its slots; returns fp32 logits
        [sum of num_logits, vocab], spans in order. A tap collects the
        hidden states entering its layers, for every token of the spans."""
        self._check(spans)
        if self.native_step is not None:
            logits = self.native_step(spans, tap)
            if logits is not None:
                return logits
        meta = self.backend.build_metadata(
            [(s.start, len(s.token_ids), list(s.block_table)) for s in spans],
            self.block_size,
            self.config.num_heads // self.config.num_kv_heads,
            self.device,
        )
        input_ids = torch.tensor([t for s in spans for t in s.token_ids], dtype=torch.int64)
        positions = torch.tensor([p for s in spans for p in range(s.start, s.end)],
                                 dtype=torch.int64)
        logits_rows: list[int] = []
        end = 0
        for s in spans:
            end += len(s.token_ids)
            logits_rows.extend(range(end - s.num_logits, end))
        logits_index = torch.tensor(logits_rows, dtype=torch.int64)
        return self.model(
            input_ids.to(self.device),
            positions.to(self.device),
            self.layer_caches,
            meta,
            self.backend,
            logits_index.to(self.device),
            tap,
        )

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: copy each src block's K/V of every layer into dst."""
        if not copies:
            return
        pairs = torch.tensor(copies, dtype=torch.int64, device=self.device)  # [num_pairs, 2]
        self.backend.copy_blocks(self.kv_cache, pairs)

    def _check(self, spans: Sequence[SeqSpan]) -> None:
        if not spans:
            raise ValueError("forward needs at least one span")
        for i, span in enumerate(spans):
            if not span.token_ids:
                raise ValueError(f"span {i} has no tokens")
            if not 0 <= span.num_logits <= len(span.token_ids):
                raise ValueError(
                    f"span {i}: num_logits {span.num_logits} outside 0..{len(span.token_ids)}"
                )
            if span.end > self.config.max_position:
                raise ValueError(
                    f"span {i} reaches position {span.end}, past the model's "
                    f"{self.config.max_position}"
                )
            if len(span.block_table) * self.block_size < span.end:
                raise ValueError(f"span {i}: block table too short for {span.end} positions")
            if min(span.token_ids) < 0 or max(span.token_ids) >= self.config.vocab_size:
                raise ValueError(f"span {i}: token id outside the vocabulary")
