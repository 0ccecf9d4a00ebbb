"""One ModelRunner per model: its KV tensors, indexed by the shared pool's
block ids, and a forward over a flattened batch of spans (core/span.py).

Spans of every kind (prefill chunks, decode tokens, the k + 1 positions the
target verifies) mix in one call; each asks for logits at its last
``num_logits`` tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from specpage.attention.backend import AttentionBackend
from specpage.core.layer_groups import LayerGroups
from specpage.core.span import Span
from specpage.executor.cuda_graphs import DecodeGraphs
from specpage.executor.kv_cache import KvCache, KvShape
from specpage.layers.products import row_invariant
from specpage.models.decoder import DecoderModel, LayerTap
from specpage.models.loader import LoadedModel, ModelLoadError
from specpage.models.native_step import NativeStep

log = logging.getLogger("specpage.engine")


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        backend: AttentionBackend | None = None,
        deterministic: bool = False,
        graphs_for: int = 0,
        max_context: int | None = None,
        groups: LayerGroups | None = None,
    ) -> None:
        """deterministic: each position's logits the same whatever else its
        forward computes (other sequences, the span it is in, the chunk):
        row-invariant products (layers/products.py row_invariant) and every
        span on the native attention kernel (attention/cpu.py)."""
        self.model = loaded.model
        self.config = c = loaded.config
        self.block_size = block_size
        self.deterministic = deterministic
        weight = self.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        # groups: the layers' KV in pages of one group each (core/layer_groups.py)
        self.kv = KvCache(KvShape(c.num_layers, num_blocks, block_size, c.num_kv_heads,
                                  c.head_dim, groups), self.dtype, self.device, backend,
                          deterministic)
        self.group_count = 1 if groups is None else len(groups.windows)
        if c.windowed and not self.kv.backend.attends_windows:
            raise ModelLoadError(
                f"{loaded.folder.name}: {c.architecture}'s sliding-window layers need an "
                f"attention backend with windows, which {type(self.kv.backend).__name__} "
                f"({self.device.type}) is not; run it on the CPU")
        self.groups = c.num_heads // c.num_kv_heads  # query heads per KV head
        self.native_step = self._native_step(loaded)
        # graphs_for: forwards of short spans (decoding, verification) of up
        # to this many sequences replayed from CUDA graphs
        # (executor/cuda_graphs.py); 0, or off CUDA: none
        self.graphs: DecodeGraphs | None = None
        if graphs_for and self.device.type == "cuda" and not deterministic and groups is None:
            self.graphs = DecodeGraphs(self.model, self.kv, block_size, graphs_for,
                                       min(max_context or c.max_position, c.max_position))

    def _native_step(self, loaded: LoadedModel) -> NativeStep | None:
        """The step from spans on the native kernels, where this model can
        take it on this machine: decided here, once; a forward then checks
        only what varies (span lengths, rows with a stack plan)."""
        if type(self.model).forward is not DecoderModel.forward:
            # a subclass's forward (a tensor-parallel shard's) must run
            reason: str | None = f"{type(self.model).__name__} has a forward of its own"
        else:
            reason = NativeStep.unusable(self.model, self.kv.backend)
        if reason is not None:
            log.info("%s: forwards through the modules, not the native step: %s",
                     loaded.folder.name, reason)
            return None
        return NativeStep(self.model, self.kv.layers, self.block_size, self.kv.layer_groups)

    @torch.inference_mode()
    def forward(self, spans: Sequence[Span], tap: LayerTap | None = None) -> torch.Tensor:
        """Writes every span's K/V into its slots; returns fp32 logits
        [sum of num_logits, vocab], spans in order. A tap collects the
        hidden states entering its layers, for every token of the spans."""
        self.check(spans)
        with row_invariant(self.deterministic):
            logits = self._forward(spans, tap)
        if self.device.type == "cuda":
            # the caller reads the logits next anyway; waiting here makes the
            # forward's measured time the device's (the policy's costs)
            torch.cuda.synchronize(self.device)
        return logits

    def _forward(self, spans: Sequence[Span], tap: LayerTap | None) -> torch.Tensor:
        if self.graphs is not None and tap is None:
            logits = self.graphs(spans)
            if logits is not None:
                return logits
        if self.native_step is not None:
            logits = self.native_step(spans, tap)
            if logits is not None:
                return logits
        meta = (self.kv.metadata(spans, self.groups) if self.group_count == 1
                else self.kv.layer_metadata(spans, self.groups))
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
            self.kv.layers,
            meta,
            self.kv.backend,
            logits_index.to(self.device),
            tap,
        )

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: copy each src block's K/V of every layer into dst."""
        self.kv.copy_blocks(copies)

    def check(self, spans: Sequence[Span]) -> None:
        """Raise ValueError for spans this model cannot run, before any runs."""
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
            if len(span.group_tables) != self.group_count - 1:
                raise ValueError(f"span {i}: {len(span.group_tables)} group tables for a model "
                                 f"whose KV is in {self.group_count} groups")
            if any(len(t) * self.block_size < span.end for t in span.group_tables):
                raise ValueError(f"span {i}: a group's table too short for {span.end} positions")
            if min(span.token_ids) < 0 or max(span.token_ids) >= self.config.vocab_size:
                raise ValueError(f"span {i}: token id outside the vocabulary")
