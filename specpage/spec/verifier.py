"""The target: one forward over every scheduled span (prefill chunks, and
the newest tokens followed by their proposals), then acceptance.

Only tokens whose KV both models hold are committed: when all k proposals
are accepted the draft has not yet seen the last one, so it stays
uncommitted and both models compute it again next step (one extra position
in a forward that is bandwidth-bound anyway).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from specpage.block_pool import BlockPool
from specpage.model_runner import ModelRunner, SeqSpan
from specpage.request import Sequence
from specpage.sampler import Purpose, sample, uniform
from specpage.scheduler import ScheduledSeq
from specpage.spec.acceptance import accept
from specpage.spec.proposer import Proposal
from specpage.spec.sampling_rows import row_probabilities


class Verdict(NamedTuple):
    num_commit: int  # positions from num_computed on whose KV both models now hold
    new_tokens: list[int]  # accepted proposals, then the recovered or bonus token
    num_proposed: int
    num_accepted: int
    logprobs: list[float]  # of new_tokens, when asked for
    fork_tokens: list[int]  # first tokens of samples 1..n-1, sampled with the first
    fork_logprobs: list[float]  # theirs, when asked for


class Verifier:
    def __init__(self, runner: ModelRunner, pool: BlockPool) -> None:
        self.runner = runner
        self.pool = pool
        # (positions, seconds) of the last forward, None when it carried prefill
        self.last_cost: tuple[int, float] | None = None

    def verify(self, scheduled: list[ScheduledSeq], proposal: Proposal) -> list[Verdict]:
        if not scheduled:
            self.last_cost = None
            return []
        spans = []
        for e, drafted in zip(scheduled, proposal.tokens, strict=True):
            start = e.seq.num_computed
            new = e.seq.token_ids[start : start + e.num_new] + drafted
            logits_wanted = len(drafted) + 1 if e.wants_logits else 0
            spans.append(SeqSpan(new, start, self.pool.block_table(e.seq.seq_id), logits_wanted))
        start = time.perf_counter()
        logits = self.runner.forward(spans)  # [sum of (k + 1) over logit rows, vocab]
        seconds = time.perf_counter() - start
        decoding = all(e.wants_logits and e.num_new <= 2 for e in scheduled)
        self.last_cost = (sum(len(s.token_ids) for s in spans), seconds) if decoding else None
        verdicts = [Verdict(e.num_new, [], 0, 0, [], [], []) for e in scheduled]
        rows = [i for i, e in enumerate(scheduled) if e.wants_logits]
        if rows:
            self._accept(scheduled, proposal, rows, logits, verdicts)
        return verdicts

    def _accept(
        self,
        scheduled: list[ScheduledSeq],
        proposal: Proposal,
        rows: list[int],
        logits: torch.Tensor,
        verdicts: list[Verdict],
    ) -> None:
        seqs = [scheduled[i].seq for i in rows]
        ks = [len(proposal.tokens[i]) for i in rows]
        offsets = [0]
        for k in ks:
            offsets.append(offsets[-1] + k + 1)  # logit rows of each sequence
        greedy = [r for r, s in enumerate(seqs) if s.request.params.greedy]
        sampled = [r for r, s in enumerate(seqs) if not s.request.params.greedy]
        num_accepted, next_token = [0] * len(rows), [0] * len(rows)
        for group, decide in ((greedy, self._greedy), (sampled, self._sampled)):
            if group:
                results = decide([rows[r] for r in group], [seqs[r] for r in group],
                                 [ks[r] for r in group], [offsets[r] for r in group],
                                 proposal, logits)
                for r, (a, token) in zip(group, results, strict=True):
                    num_accepted[r], next_token[r] = a, token
        log_probs = None
        if any(s.request.params.logprobs for s in seqs):
            log_probs = torch.log_softmax(logits, dim=-1)
        for r, (i, seq, k) in enumerate(zip(rows, seqs, ks, strict=True)):
            a = num_accepted[r]
            new_tokens = proposal.tokens[i][:a] + [next_token[r]]
            chosen = []
            if log_probs is not None and seq.request.params.logprobs:
                chosen = [float(log_probs[offsets[r] + j, t]) for j, t in enumerate(new_tokens)]
            forks = self._fork_tokens(seq, logits[offsets[r]]) if k == 0 else []
            fork_logprobs = [float(log_probs[offsets[r], t]) for t in forks] if chosen else []
            verdicts[i] = Verdict(
                num_commit=scheduled[i].num_new + min(a, max(k - 1, 0)),
                new_tokens=new_tokens,
                num_proposed=k,
                num_accepted=a,
                logprobs=chosen,
                fork_tokens=forks,
                fork_logprobs=fork_logprobs,
            )

    @staticmethod
    def _greedy(rows: list[int], seqs: list[Sequence], ks: list[int], offsets: list[int],
                proposal: Proposal, logits: torch.Tensor) -> list[tuple[int, int]]:
        """Accept while the draft token equals the target's argmax."""
        argmax = logits.argmax(-1).tolist()  # [logit rows]
        results = []
        for i, k, base in zip(rows, ks, offsets, strict=True):
            a = 0
            while a < k and proposal.tokens[i][a] == argmax[base + a]:
                a += 1
            results.append((a, argmax[base + a]))
        return results

    @staticmethod
    def _sampled(rows: list[int], seqs: list[Sequence], ks: list[int], offsets: list[int],
                 proposal: Proposal, logits: torch.Tensor) -> list[tuple[int, int]]:
        """Lossless rejection sampling over the rows' padded distributions."""
        k_max = max(ks)
        vocab = logits.shape[-1]
        index = torch.tensor([base + j for base, k in zip(offsets, ks, strict=True)
                              for j in range(k + 1)])
        row_seqs = [s for s, k in zip(seqs, ks, strict=True) for _ in range(k + 1)]
        target = row_probabilities(logits[index], row_seqs)
        target_padded = torch.zeros(len(rows), k_max + 1, vocab)
        draft_padded = torch.ones(len(rows), k_max, vocab)
        draft_tokens = torch.zeros(len(rows), k_max, dtype=torch.int64)
        start = 0
        for r, (i, k) in enumerate(zip(rows, ks, strict=True)):
            target_padded[r, : k + 1] = target[start : start + k + 1]
            start += k + 1
            if k:
                draft_padded[r, :k] = proposal.probs[i]
                draft_tokens[r, :k] = torch.tensor(proposal.tokens[i])
        u_accept = torch.tensor(
            [[uniform(s.seed, s.num_tokens + j, Purpose.ACCEPT) for j in range(k_max)]
             for s in seqs], dtype=torch.float64,
        ).view(len(rows), k_max)  # fmt: skip
        u_next = torch.tensor(
            [[uniform(s.seed, s.num_tokens + a, Purpose.RESIDUAL if a < k else Purpose.SAMPLE)
              for a in range(k_max + 1)] for s, k in zip(seqs, ks, strict=True)],
            dtype=torch.float64,
        )  # fmt: skip
        result = accept(draft_tokens, draft_padded, target_padded, torch.tensor(ks), u_accept,
                        u_next)
        return list(zip(result.num_accepted, result.next_token, strict=True))

    @staticmethod
    def _fork_tokens(seq: Sequence, logits: torch.Tensor) -> list[int]:
        n = seq.request.params.n
        if n == 1 or seq.index != 0 or seq.output_token_ids:
            return []
        probs = row_probabilities(logits[None], [seq])[0]
        draws = torch.tensor(
            [uniform(seq.seed + i, seq.num_tokens, Purpose.SAMPLE) for i in range(1, n)],
            dtype=torch.float64,
        )
        return sample(probs.expand(n - 1, -1), draws).tolist()
