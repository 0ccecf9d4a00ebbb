"""Decode forwards on CUDA replayed from captured CUDA graphs.

A small model's decode step on a GPU is bound by launching kernels, not by
running them: SmolLM2-135M's 30 layers launch a few hundred kernels a
forward, each costing the host more than the device. A forward in which
every span is one token that wants its logits (plain decoding, and each of a
draft model's proposal steps) is padded to the next batch bucket and
replayed from a graph captured once per bucket, on static buffers that each
step refills.

Padding rows write no K/V (slot -1, which `kv_write` skips), attend over one
position of block 0, and their logits are dropped. The metadata's
max_context is fixed at the engine's, so the split-K partition count is the
one for the longest context; partitions past a short sequence's end exit at
once. The rotary table is grown to max_context before the first capture, so
no later forward replaces a tensor that a graph reads.

A graph holds the addresses of the tensors it reads, not the tensors: every
one made outside it (the batch's inputs and metadata) lives in its bucket's
`_Buffers` for as long as the graph does.

Any failure to capture turns graphs off for the runner (logged once), and
forwards run eagerly as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specpage.core.span import Span

log = logging.getLogger("specpage.engine")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass
class _Buffers:
    """Every tensor made outside a graph that the graph reads: a graph holds
    their addresses, not the tensors, so they live as long as it does. (A
    buffer freed after its capture, such as the spans' query_start, hands its
    memory to other tensors, or to the driver when the next capture empties
    the cache, and the replays read whatever is there.)"""

    input_ids: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    logits_index: torch.Tensor  # [bucket] int64, every row
    meta: Any  # TritonMetadata: slot_mapping, block_tables, context_lens, query_start


@dataclass
class _Captured:
    replay: Callable[[], None]
    buffers: _Buffers
    logits: torch.Tensor  # [bucket, vocab] fp32, what a replay writes


class DecodeGraphs:
    """One runner's captured decode forwards, by batch bucket."""

    def __init__(self, model: Any, kv: Any, block_size: int, max_seqs: int,
                 max_context: int) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        self.max_context = max_context
        self.width = -(-max_context // block_size)  # block table entries per row
        self.buckets = sorted({b for b in BUCKETS if b < max_seqs} | {max_seqs})
        self.captured: dict[int, _Captured] = {}
        self.pool: Any = None  # the graphs' shared memory pool
        self.off: str | None = None  # why graphs are off, once they are
        self.replays = 0

    def takes(self, spans: Sequence[Span]) -> bool:
        return (self.off is None and len(spans) <= self.buckets[-1]
                and all(len(s.token_ids) == 1 and s.num_logits == 1
                        and s.end <= self.max_context for s in spans))

    def __call__(self, spans: Sequence[Span]) -> torch.Tensor | None:
        """Logits [len(spans), vocab], or None where this batch runs eagerly."""
        if not self.takes(spans):
            return None
        bucket = next(b for b in self.buckets if b >= len(spans))
        captured = self.captured.get(bucket) or self._capture(bucket)
        if captured is None:
            return None
        self._fill(captured, spans)
        captured.replay()
        self.replays += 1
        return captured.logits[: len(spans)].clone()

    def _fill(self, captured: _Captured, spans: Sequence[Span]) -> None:
        buffers, meta = captured.buffers, captured.buffers.meta
        n, bucket, bs = len(spans), buffers.input_ids.shape[0], self.block_size
        pad = bucket - n
        ids = [s.token_ids[0] for s in spans] + [0] * pad
        positions = [s.start for s in spans] + [0] * pad
        slots = [s.block_table[s.start // bs] * bs + s.start % bs for s in spans] + [-1] * pad
        lens = [s.end for s in spans] + [1] * pad
        used = [-(-s.end // bs) for s in spans]
        width = max(used)
        # entries past a row's context (left from earlier steps) are never read
        tables = torch.tensor([list(s.block_table[:u]) + [0] * (width - u)
                               for s, u in zip(spans, used, strict=True)], dtype=torch.int64)
        vectors = torch.tensor([ids, positions, slots, lens], dtype=torch.int64)
        buffers.input_ids.copy_(vectors[0], non_blocking=True)
        buffers.positions.copy_(vectors[1], non_blocking=True)
        meta.slot_mapping.copy_(vectors[2], non_blocking=True)
        meta.context_lens.copy_(vectors[3], non_blocking=True)
        meta.block_tables[:n, :width].copy_(tables, non_blocking=True)

    def _capture(self, bucket: int) -> _Captured | None:
        try:
            buffers = self._buffers(bucket)
            self.model.rope_rows(buffers.positions, self.model.embed_tokens.weight.dtype,
                                 need=self.max_context)  # grown once, before any capture
            replay, logits = self._record(lambda: self._forward(buffers))
        except Exception as error:  # noqa: BLE001 - any failure means eager forwards
            self.off = f"{type(error).__name__}: {error}"
            log.warning("CUDA graphs off for this model, forwards run eagerly: %s", self.off)
            return None
        captured = self.captured[bucket] = _Captured(replay, buffers, logits)
        return captured

    def _buffers(self, bucket: int) -> _Buffers:
        from specpage.attention.triton import TritonMetadata

        device = self.model.embed_tokens.weight.device

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        every_row = torch.arange(bucket + 1, dtype=torch.int64, device=device)
        meta = TritonMetadata(
            slot_mapping=torch.full((bucket,), -1, dtype=torch.int64, device=device),
            block_tables=zeros(bucket, self.width), context_lens=zeros(bucket) + 1,
            query_start=every_row, max_query=1, max_context=self.max_context)
        return _Buffers(zeros(bucket), zeros(bucket), every_row[:bucket], meta)

    def _forward(self, buffers: _Buffers) -> torch.Tensor:
        """The forward a graph records: it reads nothing made outside it but
        `buffers`, the model's tensors and the KV cache."""
        return self.model(buffers.input_ids, buffers.positions, self.kv.layers, buffers.meta,
                          self.kv.backend, buffers.logits_index)

    def _record(self, forward: Callable[[], torch.Tensor]
                ) -> tuple[Callable[[], None], torch.Tensor]:
        """Captures forward into a CUDA graph: (its replay, the logits it writes)."""
        device = self.model.embed_tokens.weight.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            forward()  # the first launches compile and allocate outside the graph
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = forward()
        self.pool = graph.pool()
        return graph.replay, logits
