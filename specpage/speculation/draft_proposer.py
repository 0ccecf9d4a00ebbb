"""The draft: up to k forwards for the batch, proposing into tentative slots.

Only sequences that speculate this step (k > 0) run through the draft. Its
first forward catches each of them up: it covers the span the core says the
draft lacks (`SeqWork.draft_tokens`, from `draft_start`; see core/proposer_rules.py
for why the draft lags) followed by this step's new tokens. Then one forward
per proposal depth, for the sequences whose k reaches it. With speculation
off the draft costs nothing.
"""

from __future__ import annotations

import time

import torch

from specpage.core.span import Span
from specpage.core.step import Cost, SeqResult, SeqWork
from specpage.speculation.proposal import Guides, Proposal, drafts, draw, guided
from specpage.speculation.runner import SpanRunner
from specpage.speculation.sampler import Purpose
from specpage.speculation.verdict import Verdict


class DraftProposer:
    """A draft model as a proposer (speculation/proposal.py's Proposer)."""

    def __init__(self, runner: SpanRunner, coupled: bool = False) -> None:
        """coupled: samples propose with the draws the target's tokens take
        (a coupled verifier, speculation/verifier.py)."""
        self.runner = runner
        self.purpose = Purpose.SAMPLE if coupled else Purpose.DRAFT

    def _forward(self, spans: list[Span], costs: list[Cost]) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.runner.forward(spans)
        costs.append((sum(len(s.token_ids) for s in spans), time.perf_counter() - start))
        return logits

    def propose(self, batch: list[SeqWork], guides: Guides) -> Proposal:
        """guides: the grammars of the constrained sequences (proposal.py)."""
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
            live = guided(logits, [batch[i] for i in active], [tokens[i] for i in active],
                          guides)
            if len(live) < len(active):  # a grammar left one nothing to propose
                logits, active = logits[live], [active[row] for row in live]
                if not active:
                    break
            draw(logits, [batch[i] for i in active], depth, [tokens[i] for i in active],
                 [probs[i] for i in active], self.purpose)
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
