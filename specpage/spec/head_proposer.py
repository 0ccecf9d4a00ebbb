"""An EAGLE-3 head as the proposer: it drafts from the target's own hidden
states, and keeps its one layer's KV in the shared pool.

Each step has two parts for the head. Before verification it proposes: the
first proposal comes from its state (its output at the position before the
newest token, kept by the core between steps), each further one from a
forward at the next position that feeds its own previous output in place
of the target's features (as vLLM does), writing K/V into tentative slots.
After verification it absorbs: one forward over every position the target
computed whose next token is now known (the span's tokens and the accepted
proposals), reading the target's features there, which overwrites the
tentative K/V with the real thing and leaves the state for the next step.
Every sequence of the step is absorbed, speculating or not (core/ledger.py
says why the head never lags); only proposals need its LM head.
"""

from __future__ import annotations

import time

import msgspec
import torch

from specpage.core.step import Cost, SeqResult, SeqWork
from specpage.model_runner import SeqSpan
from specpage.spec.head_runner import HeadRunner
from specpage.spec.proposer import Proposal, draw
from specpage.spec.verdict import Verdict


def encode_state(row: torch.Tensor) -> bytes:
    return row.detach().float().cpu().numpy().tobytes()


def decode_state(state: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(state), dtype=torch.float32)


class HeadProposer:
    def __init__(self, runner: HeadRunner) -> None:
        self.runner = runner

    def propose(self, batch: list[SeqWork]) -> Proposal:
        tokens: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        costs: list[Cost] = []
        active = [i for i, w in enumerate(batch) if w.k > 0]
        if not active:
            return Proposal.none(len(batch))
        start = time.perf_counter()
        # [rows, hidden]: each row's output at the position before its newest token
        states = torch.stack([decode_state(batch[i].draft_state) for i in active])
        logits = self.runner.logits(states.to(self.runner.device))
        depth = 0
        while True:
            draw(logits, [batch[i] for i in active], depth, [tokens[i] for i in active],
                 [probs[i] for i in active])
            costs.append((len(active), time.perf_counter() - start))
            depth += 1
            keep = [row for row, i in enumerate(active) if batch[i].k > depth]
            if not keep:
                break
            active = [active[row] for row in keep]
            start = time.perf_counter()
            # the head at position end - 2 + depth embeds its last proposal
            # (the token after that position) and reads its own last output
            spans = [SeqSpan([tokens[i][-1]], batch[i].end - 2 + depth, batch[i].block_table)
                     for i in active]
            states = self.runner.run(spans, states[keep])
            logits = self.runner.logits(states)
        return Proposal(tokens, [torch.stack(p) if p else None for p in probs], costs)

    def absorb(self, batch: list[SeqWork], proposal: Proposal,
               verdict: Verdict) -> tuple[list[SeqResult], list[Cost]]:
        """The head over every position the target now holds for good,
        reading the target's features there; each result gets its state."""
        assert verdict.features is not None, "the verifier tapped no features"
        start = time.perf_counter()
        spans, rows, offset = [], [], 0
        for w, drafted, done in zip(batch, proposal.tokens, verdict.results, strict=True):
            if w.sample:
                following = (w.tokens + done.tokens)[1:]  # up to the next token sampled
            else:
                assert w.following >= 0, w
                following = w.tokens[1:] + [w.following]
            spans.append(SeqSpan(following, w.start, w.block_table))
            rows.extend(range(offset, offset + len(following)))
            offset += len(w.tokens) + len(drafted)  # the target's rows for this span
        out = self.runner.run(spans, self.runner.features(verdict.features[rows]))
        ends = torch.tensor([len(s.token_ids) for s in spans]).cumsum(0) - 1
        results = [msgspec.structs.replace(done, draft_state=encode_state(out[int(end)]))
                   for done, end in zip(verdict.results, ends, strict=True)]
        return results, [(len(rows), time.perf_counter() - start)]
