"""What every proposer that runs a model gives the verifier, and the one
interface they share: a draft model (draft_proposer.py) and an EAGLE-3
head (head_proposer.py). The core's own proposals (the proposers that need
no model) arrive in the batch itself and join a proposal here.

A constrained sequence (its SeqWork carries `allowed`) drafts under its
grammar: the core hands the executor each such sequence's `Guide` beside
the batch, in the same process (the batch stays plain values; the guide
is the one thing that is not). At every depth the draft's logits are
masked to what the grammar admits after the proposals so far (`guided`),
so a greedy draft proposes only admitted tokens and a sampled one draws
from its distribution under the mask, which is then the q that
verification reads: still lossless. A row whose draft scores no admitted
token stops proposing there. The masks of the rows the target samples
then follow from the proposals (`with_masks`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import msgspec
import torch

from specpage.core.step import Cost, SeqResult, SeqWork
from specpage.speculation.sampler import Purpose, sample
from specpage.speculation.sampling_rows import (
    greedy_tokens,
    mask_rows_,
    row_probabilities,
    uniforms,
)
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


class Guide(Protocol):
    """A constrained sequence's grammar as the executor asks it
    (core/grammar.py's SequenceGrammar): bitmasks, one bit per token, 32 to
    a little-endian int32."""

    def draft_mask(self, proposal: list[int]) -> bytes:
        """What a draft may propose after proposal: one row."""
        ...

    def masks(self, proposal: list[int]) -> bytes:
        """What the target may sample at each row it verifies proposal with."""
        ...


Guides = Mapping[int, Guide]  # by seq_id: each constrained sequence the draft proposes for


def guided(logits: torch.Tensor, works: list[SeqWork], tokens: list[list[int]],
           guides: Guides) -> list[int]:
    """The rows of logits [rows, vocab] (one per work, its proposals so far
    in tokens) that propose at this depth: a constrained row's logits are
    masked in place to what its grammar lets the draft propose next, and it
    stops where that leaves it nothing."""
    constrained = [r for r, w in enumerate(works) if w.allowed] if guides else []
    if not constrained:
        return list(range(len(works)))
    masks = b"".join(guides[works[r].seq_id].draft_mask(tokens[r]) for r in constrained)
    mask_rows_(logits, constrained, masks)
    best = logits[constrained].amax(-1).tolist()
    stopped = {r for r, b in zip(constrained, best, strict=True) if b == float("-inf")}
    return [r for r in range(len(works)) if r not in stopped]


def with_masks(batch: list[SeqWork], proposal: Proposal, guides: Guides) -> list[SeqWork]:
    """The batch with each constrained sequence the draft proposed for
    carrying the masks of the rows the target samples (the core could lay
    only the first: the proposals were not made yet)."""
    if not guides:
        return batch
    return [msgspec.structs.replace(w, allowed=guides[w.seq_id].masks(drafted))
            if w.allowed and drafted and drafts(w) else w
            for w, drafted in zip(batch, proposal.tokens, strict=True)]


class Proposer(Protocol):
    """A model that proposes: a step's proposals for the batch, then what it
    keeps of the verified step (its KV state, measured costs)."""

    def propose(self, batch: list[SeqWork], guides: Guides) -> Proposal: ...

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
        for row, token in enumerate(greedy_tokens(logits)):
            tokens[row].append(token)
        return
    positions = [w.end + depth for w in works]  # where each proposal goes
    p = row_probabilities(logits, rows)
    for row, token in enumerate(sample(p, uniforms(rows, positions, purpose)).tolist()):
        tokens[row].append(token)
        probs[row].append(p[row])
