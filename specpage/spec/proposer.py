"""The draft: up to k forwards for the batch, proposing into tentative slots.

Only sequences that speculate this step (k > 0) run through the draft. Its
first forward catches each of them up: it covers every token from the
sequence's `num_draft_computed` (where the draft's KV ends; it lags while a
sequence does not speculate, and starts at 0 after a prefix-cache hit,
since cached blocks vouch for the target's KV only) through this step's new
tokens. Then one forward per proposal depth, for the sequences whose k
reaches it. With speculation off the draft costs nothing.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from specpage.block_pool import BlockPool
from specpage.model_runner import ModelRunner, SeqSpan
from specpage.sampler import Purpose, sample
from specpage.scheduler import ScheduledSeq
from specpage.spec.sampling_rows import row_probabilities, uniforms


class Proposal(NamedTuple):
    tokens: list[list[int]]  # per scheduled sequence, its k proposed tokens
    probs: list[torch.Tensor | None]  # per scheduled sequence, [k, vocab] draft probabilities


class DraftProposer:
    def __init__(self, runner: ModelRunner, pool: BlockPool) -> None:
        self.runner = runner
        self.pool = pool
        self.last_costs: list[tuple[int, float]] = []  # (positions, seconds) per forward

    def _forward(self, spans: list[SeqSpan]) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.runner.forward(spans)
        self.last_costs.append((sum(len(s.token_ids) for s in spans),
                                time.perf_counter() - start))
        return logits

    def propose(self, scheduled: list[ScheduledSeq]) -> Proposal:
        tokens: list[list[int]] = [[] for _ in scheduled]
        probs: list[list[torch.Tensor]] = [[] for _ in scheduled]
        active = [i for i, e in enumerate(scheduled) if e.k > 0]
        self.last_costs = []
        if not active:
            return Proposal(tokens, [None for _ in scheduled])
        tables = {i: self.pool.block_table(scheduled[i].seq.seq_id) for i in active}
        spans = []
        for i in active:
            seq, end = scheduled[i].seq, scheduled[i].seq.num_computed + scheduled[i].num_new
            spans.append(SeqSpan(seq.token_ids[seq.num_draft_computed : end],
                                 seq.num_draft_computed, tables[i], num_logits=1))
        logits = self._forward(spans)
        depth = 0
        while active:
            seqs = [scheduled[i].seq for i in active]
            if all(s.request.params.greedy for s in seqs):
                # Greedy acceptance compares tokens only; no distributions needed.
                drawn = logits.argmax(-1).tolist()
                for row, i in enumerate(active):
                    tokens[i].append(drawn[row])
            else:
                positions = [s.num_tokens + depth for s in seqs]  # where each proposal goes
                p = row_probabilities(logits, seqs)
                drawn = sample(p, uniforms(seqs, positions, Purpose.DRAFT)).tolist()
                for row, i in enumerate(active):
                    tokens[i].append(drawn[row])
                    probs[i].append(p[row])
            depth += 1
            active = [i for i in active if scheduled[i].k > depth]
            if not active:
                break
            spans = [SeqSpan([tokens[i][-1]], scheduled[i].seq.num_tokens + depth - 1, tables[i])
                     for i in active]
            logits = self._forward(spans)
        return Proposal(tokens, [torch.stack(p) if p else None for p in probs])
