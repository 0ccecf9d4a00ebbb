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

Only proposals need the head's state, so a sequence that does not
speculate leaves its positions unabsorbed while they stay within the block
the target is filling (core/proposer_rules.py): it carries their tapped states, and
the next forward over it (a proposal's, or an absorb that runs anyway)
takes them first. A step in which no sequence needs the head runs no head
forward at all, so speculation switched off costs the head nothing but a
forward over a block's positions once per block, and that one mostly the
qkv projection: only a span's last position, the next state, goes on
through attention and the MLP (HeadRunner.run).

A sequence the policy left the head off (`SeqWork.draft_on`, core/ledger.py)
costs the head nothing at all: it neither absorbs nor carries anything.
"""

from __future__ import annotations

import time

import msgspec
import torch

from specpage.core.span import Span
from specpage.core.step import Cost, SeqResult, SeqWork
from specpage.speculation.proposal import Guides, Proposal, drafts, draw, guided
from specpage.speculation.runner import DraftHead
from specpage.speculation.sampler import Purpose
from specpage.speculation.verdict import Verdict


def decode_state(state: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(state), dtype=torch.float32)


class HeadProposer:
    def __init__(self, runner: DraftHead, coupled: bool = False) -> None:
        """coupled: as DraftProposer's."""
        self.runner = runner
        self.purpose = Purpose.SAMPLE if coupled else Purpose.DRAFT
        self.hidden = runner.hidden_size
        self.taps = runner.tap_width  # a position's tapped states, concatenated

    def _state(self, w: SeqWork) -> tuple[torch.Tensor, torch.Tensor]:
        """w's head output at draft_start - 1 [hidden] and the tapped states of
        the positions it has not absorbed [draft_start .. start - 1, taps]."""
        raw = decode_state(w.draft_state)
        return raw[: self.hidden], raw[self.hidden :].view(-1, self.taps)

    @staticmethod
    def _unabsorbed(w: SeqWork) -> list[int]:
        """The tokens the head embeds at the positions it has not absorbed:
        each one's next token."""
        return w.draft_tokens[1:] + w.tokens[:1] if w.draft_tokens else []

    def propose(self, batch: list[SeqWork], guides: Guides) -> Proposal:
        """guides: the grammars of the constrained sequences (proposal.py)."""
        tokens: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        costs: list[Cost] = []
        active = [i for i, w in enumerate(batch) if drafts(w)]
        if not active:
            return Proposal.none(len(batch))
        start = time.perf_counter()
        # [rows, hidden]: each row's output at the position before its newest token
        held = [self._state(batch[i]) for i in active]
        states = torch.stack([state for state, _ in held]).to(self.runner.device)
        behind = [row for row, i in enumerate(active) if batch[i].draft_tokens]
        if behind:  # first the positions they left unabsorbed
            lagging = [batch[active[row]] for row in behind]
            spans = [Span(self._unabsorbed(w), w.draft_start, w.block_table) for w in lagging]
            taps = torch.cat([held[row][1] for row in behind])
            out = self.runner.run(spans, self.runner.features(taps))  # each span's last
            states = states.to(out.dtype)
            states[behind] = out
            costs.append((len(taps), time.perf_counter() - start))
            start = time.perf_counter()
        logits = self.runner.logits(states)
        depth = 0
        while True:
            # the first proposal projects the state the last absorb left: that
            # absorb's forward, finished (absorb counts it with its own)
            forward = 0 if depth == 0 else len(active)
            live = guided(logits, [batch[i] for i in active], [tokens[i] for i in active],
                          guides)
            if len(live) < len(active):  # a grammar left one nothing to propose
                logits, states, active = logits[live], states[live], [active[r] for r in live]
            if active:
                draw(logits, [batch[i] for i in active], depth, [tokens[i] for i in active],
                     [probs[i] for i in active], self.purpose)
            costs.append((forward, time.perf_counter() - start))
            depth += 1
            keep = [row for row, i in enumerate(active) if batch[i].k > depth]
            if not keep:
                break
            active = [active[row] for row in keep]
            start = time.perf_counter()
            # the head at position end - 2 + depth embeds its last proposal
            # (the token after that position) and reads its own last output
            spans = [Span([tokens[i][-1]], batch[i].end - 2 + depth, batch[i].block_table)
                     for i in active]
            states = self.runner.run(spans, states[keep])
            logits = self.runner.logits(states)
        return Proposal(tokens, [torch.stack(p) if p else None for p in probs], costs)

    def _needs_forward(self, w: SeqWork) -> bool:
        """Whether the head must absorb w's positions this step: it proposed
        (its next proposal starts from them), the span does not sample (a
        prefill chunk), it has no state to carry them after, or they would
        fill the block (see core/proposer_rules.py)."""
        if w.k > 0 or not w.sample or not w.draft_state:
            return True
        return w.end // self.runner.block_size != w.draft_start // self.runner.block_size

    def absorb(self, batch: list[SeqWork], proposal: Proposal,
               verdict: Verdict) -> tuple[list[SeqResult], list[Cost]]:
        """The head over the positions the target now holds for good, reading
        the target's features there, for the sequences that need it; the
        others carry the features on. Each result gets its state."""
        if not any(w.draft_on for w in batch):
            return list(verdict.results), []
        assert verdict.features is not None, "the verifier tapped no features"
        start = time.perf_counter()
        results = list(verdict.results)
        spans, taps, absorbing, offset = [], [], [], 0
        carried = None  # the features as fp32 host memory, once some sequence carries them
        for i, (w, drafted, done) in enumerate(zip(batch, proposal.tokens, verdict.results,
                                                     strict=True)):
            if w.sample:
                following = (w.tokens + done.tokens)[1:]  # up to the next token sampled
            else:
                assert w.following >= 0, w
                following = w.tokens[1:] + [w.following]
            first, offset = offset, offset + len(w.tokens) + len(drafted)  # the span's rows
            last = first + len(following)
            if not w.draft_on:  # the head keeps nothing for it (core/proposer_rules.py)
                continue
            if not self._needs_forward(w):
                if carried is None:
                    carried = verdict.features.detach().float().cpu().numpy()
                results[i] = msgspec.structs.replace(
                    done, draft_state=w.draft_state + carried[first:last].tobytes(),
                    draft_lag=len(w.draft_tokens) + len(following))
                continue
            rows = verdict.features[first:last]
            if drafts(w) or not w.draft_tokens:  # a proposal took what it left unabsorbed
                spans.append(Span(following, w.start, w.block_table))
            else:
                spans.append(Span(self._unabsorbed(w) + following, w.draft_start,
                                     w.block_table))
                taps.append(self._state(w)[1].to(rows.dtype))
            taps.append(rows)
            absorbing.append(i)
        if not spans:
            return results, []
        hidden = torch.cat(taps)
        out = self.runner.run(spans, self.runner.features(hidden))  # each span's last
        states = out.detach().float().cpu().numpy()
        for i, state in zip(absorbing, states, strict=True):
            results[i] = msgspec.structs.replace(results[i], draft_state=state.tobytes(),
                                                 draft_lag=0)
        # with this step's first projections (proposal costs of no positions):
        # a proposal-like forward, as the policy prices one
        seconds = time.perf_counter() - start + sum(c for n, c in proposal.costs if n == 0)
        return results, [(len(hidden), seconds)]
