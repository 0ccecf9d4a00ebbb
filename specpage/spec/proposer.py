"""The draft: k forwards for the whole batch, proposing into tentative slots.

Its first forward covers every scheduled sequence's new tokens (whether or
not it speculates this step), so the draft holds KV for every token the
pool commits; then one forward per proposal depth, for the sequences whose
k reaches it.
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
        self.last_cost: tuple[int, float] | None = None  # (sequences, seconds) per forward

    def propose(self, scheduled: list[ScheduledSeq]) -> Proposal:
        tokens: list[list[int]] = [[] for _ in scheduled]
        probs: list[list[torch.Tensor]] = [[] for _ in scheduled]
        tables = [self.pool.block_table(e.seq.seq_id) for e in scheduled]
        spans = [
            SeqSpan(e.seq.token_ids[e.seq.num_computed : e.seq.num_computed + e.num_new],
                    e.seq.num_computed, table, num_logits=int(e.k > 0))
            for e, table in zip(scheduled, tables, strict=True)
        ]  # fmt: skip
        active = [i for i, e in enumerate(scheduled) if e.k > 0]
        start, forwards = time.perf_counter(), 1
        logits = self.runner.forward(spans)
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
            logits = self.runner.forward(spans)
            forwards += 1
        seconds = time.perf_counter() - start
        self.last_cost = (len(scheduled), seconds / forwards)
        return Proposal(tokens, [torch.stack(p) if p else None for p in probs])
