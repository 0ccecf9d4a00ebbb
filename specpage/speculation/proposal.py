"""What every proposer that runs a model gives the verifier, and the one
interface they share: a draft model (draft_proposer.py) and an EAGLE-3
head (head_proposer.py). The core's own proposals (the proposers that need
no model) arrive in the batch itself and join a proposal here."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from specpage.core.step import Cost, SeqResult, SeqWork
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


class Proposer(Protocol):
    """A model that proposes: a step's proposals for the batch, then what it
    keeps of the verified step (its KV state, measured costs)."""

    def propose(self, batch: list[SeqWork]) -> Proposal: ...

    def absorb(self, batch: list[SeqWork], proposal: Proposal,
               verdict: Verdict) -> tuple[list[SeqResult], list[Cost]]: ...


def draw(logits: torch.Tensor, works: list[SeqWork], depth: int, tokens: list[list[int]],
         probs: list[list[torch.Tensor]], purpose: Purpose = Purpose.DRAFT) -> None:
    """Each row's proposal at this depth from its logits [rows, vocab],
    appended to its tokens (and its distribution to its probs, when sampling).
    purpose SAMPLE: the draw the target's token at that position takes
    (a coupled verifier's), so that the proposal is likelier to equal it."""
    rows = [w.sampling for w in works]
    if all(r.greedy for r in rows):
        # Greedy acceptance compares tokens only; no distributions needed.
        for row, token in enumerate(logits.argmax(-1).tolist()):
            tokens[row].append(token)
        return
    positions = [w.end + depth for w in works]  # where each proposal goes
    p = row_probabilities(logits, rows)
    for row, token in enumerate(sample(p, uniforms(rows, positions, purpose)).tolist()):
        tokens[row].append(token)
        probs[row].append(p[row])
