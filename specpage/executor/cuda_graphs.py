"""Decode and verification forwards on CUDA replayed from captured CUDA
graphs.

A small model's decode step on a GPU is bound by launching kernels, not by
running them: SmolLM2-135M's 30 layers launch a few hundred kernels a
forward, each costing the host more than the device, so a verification of
k + 1 positions launched eagerly costs what a decode step does. A forward in
which every span is short (plain decoding, a draft model's proposal steps,
verification of k proposals: k + 1 tokens, a draft catching up on the
tokens verification accepted) is padded to a bucket of sequences and a span
length q, and replayed from a graph captured once per (bucket, q), on
static buffers that each step refills.

Padding writes no K/V (slot -1, which `kv_write` skips), and its logits are
dropped. A span shorter than q is padded at its end: each sequence's
context is taken as its start + q, so its real tokens keep their positions
and (the attention being causal) see none of the padding, whose rows attend
over positions the block table maps to block 0 or the sequence's own.
Padding sequences attend over q positions of whatever blocks their rows of
the table held last. The metadata's max_context is
fixed at the engine's plus the longest q, so the split-K partition count is
the one for the longest context; partitions past a short sequence's end exit
at once. The rotary table is grown to that length before the first capture,
so no later forward replaces a tensor that a graph reads.

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
SPAN_BUCKETS = (1, 2, 4, 6, 8, 12, 16)  # tokens a sequence (k + 1 of a verification)
MAX_ROWS = 64  # query rows paged_decode holds: span tokens x query heads per KV head
# Token rows a graph computes at most (sequences x span tokens): more run
# eagerly, where launching kernels costs the step least.
MAX_GRAPH_TOKENS = 2048


@dataclass
class _Buffers:
    """Every tensor made outside a graph that the graph reads: a graph holds
    their addresses, not the tensors, so they live as long as it does. (A
    buffer freed after its capture, such as the spans' query_start, hands its
    memory to other tensors, or to the driver when the next capture empties
    the cache, and the replays read whatever is there.)"""

    input_ids: torch.Tensor  # [bucket * q] int64
    positions: torch.Tensor  # [bucket * q] int64
    logits_index: torch.Tensor  # [bucket * q] int64, every row
    meta: Any  # TritonMetadata: slot_mapping, block_tables, context_lens, query_start


@dataclass
class _Captured:
    replay: Callable[[], None]
    buffers: _Buffers
    logits: torch.Tensor  # [bucket * q, vocab] fp32, rows of the shared buffer a replay writes


class DecodeGraphs:
    """One runner's captured forwards of short spans, by (batch bucket, span length)."""

    def __init__(self, model: Any, kv: Any, block_size: int, max_seqs: int,
                 max_context: int) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        groups = model.config.num_heads // model.config.num_kv_heads
        self.spans = [q for q in SPAN_BUCKETS if q * groups <= MAX_ROWS]
        self.max_context = max_context  # the engine's: no span ends past it
        # positions a padded span may reach; the rotary table and block tables cover them
        self.reach = max_context + self.spans[-1]
        self.width = -(-self.reach // block_size)  # block table entries per row
        self.buckets = sorted({b for b in BUCKETS if b < max_seqs} | {max_seqs})
        self.captured: dict[tuple[int, int], _Captured] = {}
        self.pool: Any = None  # the graphs' shared memory pool
        self.logits_buffer: torch.Tensor | None = None  # what every graph's logits go to
        self.off: str | None = None  # why graphs are off, once they are
        self.replays = 0

    def takes(self, spans: Sequence[Span]) -> bool:
        """Whether every span is short and ends inside the engine's context."""
        longest = self.spans[-1]
        return (self.off is None and 0 < len(spans) <= self.buckets[-1]
                and all(0 < len(s.token_ids) <= longest and s.end <= self.max_context
                        for s in spans))

    def __call__(self, spans: Sequence[Span]) -> torch.Tensor | None:
        """Logits [sum of num_logits, vocab], spans in order, or None where this
        batch runs eagerly."""
        if not self.takes(spans):
            return None
        bucket = next(b for b in self.buckets if b >= len(spans))
        q = next(q for q in self.spans if q >= max(len(s.token_ids) for s in spans))
        if bucket * q > MAX_GRAPH_TOKENS:
            return None
        captured = self.captured.get((bucket, q)) or self._capture(bucket, q)
        if captured is None:
            return None
        self._fill(captured, spans)
        captured.replay()
        self.replays += 1
        if all(len(s.token_ids) == s.num_logits == q for s in spans):
            return captured.logits[: len(spans) * q].clone()
        # each span's last num_logits real rows
        rows = [i * q + j for i, s in enumerate(spans)
                for j in range(len(s.token_ids) - s.num_logits, len(s.token_ids))]
        return captured.logits.index_select(
            0, torch.tensor(rows, dtype=torch.int64).to(captured.logits.device))

    def _fill(self, captured: _Captured, spans: Sequence[Span]) -> None:
        buffers = captured.buffers
        meta, q = buffers.meta, buffers.meta.max_query  # q: the tokens each span is padded to
        n, bs = len(spans), self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in spans:
            pad = q - len(s.token_ids)
            ids += [*s.token_ids] + [0] * pad
            positions += range(s.start, s.start + q)
            slots += [s.block_table[p // bs] * bs + p % bs for p in range(s.start, s.end)]
            slots += [-1] * pad
        rest = buffers.input_ids.shape[0] - n * q  # the padding sequences' rows
        lens = [s.start + q for s in spans] + [q] * (rest // q)
        used = [-(-(s.start + q) // bs) for s in spans]
        width = max(used)
        # a span's padding may reach past its blocks: block 0, which only the
        # padding's own rows see; entries past a row's context (left from
        # earlier steps) are never read
        tables = torch.tensor([[*s.block_table[:u]] + [0] * (width - min(u, len(s.block_table)))
                               for s, u in zip(spans, used, strict=True)], dtype=torch.int64)
        vectors = torch.tensor([ids + [0] * rest, positions + [0] * rest, slots + [-1] * rest],
                               dtype=torch.int64)
        buffers.input_ids.copy_(vectors[0], non_blocking=True)
        buffers.positions.copy_(vectors[1], non_blocking=True)
        meta.slot_mapping.copy_(vectors[2], non_blocking=True)
        meta.context_lens.copy_(torch.tensor(lens, dtype=torch.int64), non_blocking=True)
        meta.block_tables[:n, :width].copy_(tables, non_blocking=True)

    def _capture(self, bucket: int, q: int) -> _Captured | None:
        try:
            buffers = self._buffers(bucket, q)
            self.model.rope_rows(buffers.positions, self.model.embed_tokens.weight.dtype,
                                 need=self.reach)  # grown once, before any capture
            replay, logits = self._record(lambda: self._forward(buffers))
        except Exception as error:  # noqa: BLE001 - any failure means eager forwards
            self.off = f"{type(error).__name__}: {error}"
            log.warning("CUDA graphs off for this model, forwards run eagerly: %s", self.off)
            return None
        captured = self.captured[bucket, q] = _Captured(replay, buffers, logits)
        return captured

    def _buffers(self, bucket: int, q: int) -> _Buffers:
        from specpage.attention.triton import TritonMetadata

        device = self.model.embed_tokens.weight.device

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        rows = torch.arange(bucket * q + 1, dtype=torch.int64, device=device)
        meta = TritonMetadata(
            slot_mapping=torch.full((bucket * q,), -1, dtype=torch.int64, device=device),
            block_tables=zeros(bucket, self.width), context_lens=zeros(bucket) + q,
            query_start=rows[::q].contiguous(), max_query=q, max_context=self.reach)
        return _Buffers(zeros(bucket * q), zeros(bucket * q), rows[:-1], meta)

    def _forward(self, buffers: _Buffers) -> torch.Tensor:
        """The forward a graph records: it reads nothing made outside it but
        `buffers`, the model's tensors and the KV cache. Its logits are copied
        into rows of one buffer that every graph shares (those of a bucket of
        256 sequences x 8 tokens of a 49,152-token vocabulary take 400 MB: one
        a graph would add up), and it returns them, a view of that buffer."""
        logits = self.model(buffers.input_ids, buffers.positions, self.kv.layers, buffers.meta,
                            self.kv.backend, buffers.logits_index)
        out = self._logits_rows(logits)
        out.copy_(logits)
        return out

    def _logits_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """The first rows of the shared logits buffer, for logits' shape: a
        larger one when they outgrow it (twice the rows, so that few are
        made), the graphs that write the smaller one keeping it."""
        rows, width = logits.shape
        shared = self.logits_buffer
        if shared is None or shared.shape[0] < rows or shared.shape[1] != width:
            grown = rows if shared is None else max(rows, 2 * shared.shape[0])
            shared = self.logits_buffer = logits.new_empty(
                (min(grown, self._max_rows()), width))
        return shared[:rows]

    def _max_rows(self) -> int:
        """The most logits rows a graph writes (its sequences x span tokens)."""
        return min(self.buckets[-1] * self.spans[-1], MAX_GRAPH_TOKENS)

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
