"""The draft: up to k forwards for the batch, proposing into tentative slots.

Only sequences that speculate this step (k > 0) run through the draft. Its
first forward catches each of them up: it covers the span the core says the
draft lacks (`SeqWork.draft_tokens`, from `draft_start`; see core/ledger.py
for why the draft lags) followed by this step's new tokens. Then one forward
per proposal depth, for the sequences whose k reaches it. With speculation
off the draft costs nothing.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from specpage.core.step import Cost, SeqWork
from specpage.model_runner import ModelRunner, SeqSpan
from specpage.sampler import Purpose, sample
from specpage.spec.sampling_rows import row_probabilities, uniforms


class Proposal(NamedTuple):
    tokens: list[list[int]]  # per sequence of the batch, its k proposed tokens
    probs: list[torch.Tensor | None]  # per sequence, [k, vocab] draft probabilities
    costs: list[Cost]  # (positions, seconds) of each draft forward

    @classmethod
    def none(cls, size: int) -> Proposal:
        return cls([[] for _ in range(size)], [None] * size, [])


class DraftProposer:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def _forward(self, spans: list[SeqSpan], costs: list[Cost]) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.runner.forward(spans)
        costs.append((sum(len(s.token_ids) for s in spans), time.perf_counter() - start))
        return logits

    def propose(self, batch: list[SeqWork]) -> Proposal:
        tokens: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        costs: list[Cost] = []
        active = [i for i, w in enumerate(batch) if w.k > 0]
        if not active:
            return Proposal.none(len(batch))
        spans = [SeqSpan(batch[i].draft_tokens + batch[i].tokens, batch[i].draft_start,
                         batch[i].block_table, num_logits=1) for i in active]
        logits = self._forward(spans, costs)
        depth = 0
        while active:
            rows = [batch[i].sampling for i in active]
            if all(r.greedy for r in rows):
                # Greedy acceptance compares tokens only; no distributions needed.
                drawn = logits.argmax(-1).tolist()
                for row, i in enumerate(active):
                    tokens[i].append(drawn[row])
            else:
                positions = [batch[i].end + depth for i in active]  # where each proposal goes
                p = row_probabilities(logits, rows)
                drawn = sample(p, uniforms(rows, positions, Purpose.DRAFT)).tolist()
                for row, i in enumerate(active):
                    tokens[i].append(drawn[row])
                    probs[i].append(p[row])
            depth += 1
            active = [i for i in active if batch[i].k > depth]
            if not active:
                break
            spans = [SeqSpan([tokens[i][-1]], batch[i].end + depth - 1, batch[i].block_table)
                     for i in active]
            logits = self._forward(spans, costs)
        return Proposal(tokens, [torch.stack(p) if p else None for p in probs], costs)
