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

from specpage.core.span import Span
from specpage.core.step import Cost, SeqResult, SeqWork
from specpage.speculation.runner import SpanRunner
from specpage.speculation.sampler import Purpose, sample
from specpage.speculation.sampling_rows import row_probabilities, uniforms
from specpage.speculation.verdict import Verdict


class Proposal(NamedTuple):
    tokens: list[list[int]]  # per sequence of the batch, its k proposed tokens
    probs: list[torch.Tensor | None]  # per sequence, [k, vocab] draft probabilities
    costs: list[Cost]  # (positions, seconds) of each draft forward

    @classmethod
    def none(cls, size: int) -> Proposal:
        return cls([[] for _ in range(size)], [None] * size, [])

    def with_core(self, batch: list[SeqWork]) -> Proposal:
        """With the core's own proposals (SeqWork.proposal) in their rows: no
        distribution, as if drawn with certainty (q one-hot, speculation/verifier.py)."""
        if not any(w.proposal for w in batch):
            return self
        tokens = [list(w.proposal) if w.proposal else drafted
                  for w, drafted in zip(batch, self.tokens, strict=True)]
        return Proposal(tokens, self.probs, self.costs)


def drafts(w: SeqWork) -> bool:
    """Whether the draft proposes for w this step (not the core)."""
    return w.k > 0 and not w.proposal


class DraftProposer:
    def __init__(self, runner: SpanRunner) -> None:
        self.runner = runner

    def _forward(self, spans: list[Span], costs: list[Cost]) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.runner.forward(spans)
        costs.append((sum(len(s.token_ids) for s in spans), time.perf_counter() - start))
        return logits

    def propose(self, batch: list[SeqWork]) -> Proposal:
        tokens: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        costs: list[Cost] = []
        active = [i for i, w in enumerate(batch) if drafts(w)]
        if not active:
            return Proposal.none(len(batch))
        spans = [Span(batch[i].draft_tokens + batch[i].tokens, batch[i].draft_start,
                         batch[i].block_table, num_logits=1) for i in active]
        logits = self._forward(spans, costs)
        depth = 0
        while active:
            draw(logits, [batch[i] for i in active], depth, [tokens[i] for i in active],
                 [probs[i] for i in active])
            depth += 1
            active = [i for i in active if batch[i].k > depth]
            if not active:
                break
            spans = [Span([tokens[i][-1]], batch[i].end + depth - 1, batch[i].block_table)
                     for i in active]
            logits = self._forward(spans, costs)
        return Proposal(tokens, [torch.stack(p) if p else None for p in probs], costs)

    def absorb(self, batch: list[SeqWork], proposal: Proposal,
               verdict: Verdict) -> tuple[list[SeqResult], list[Cost]]:
        """A draft model reads only tokens: nothing of the target's to keep."""
        return verdict.results, []


def draw(logits: torch.Tensor, works: list[SeqWork], depth: int, tokens: list[list[int]],
         probs: list[list[torch.Tensor]]) -> None:
    """Each row's proposal at this depth from its logits [rows, vocab],
    appended to its tokens (and its distribution to its probs, when sampling)."""
    rows = [w.sampling for w in works]
    if all(r.greedy for r in rows):
        # Greedy acceptance compares tokens only; no distributions needed.
        for row, token in enumerate(logits.argmax(-1).tolist()):
            tokens[row].append(token)
        return
    positions = [w.end + depth for w in works]  # where each proposal goes
    p = row_probabilities(logits, rows)
    for row, token in enumerate(sample(p, uniforms(rows, positions, Purpose.DRAFT)).tolist()):
        tokens[row].append(token)
        probs[row].append(p[row])
