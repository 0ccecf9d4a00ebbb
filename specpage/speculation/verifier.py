"""The target: one forward over every scheduled span (prefill chunks, and
the newest tokens followed by their proposals), then acceptance.

It reports what it accepted and sampled; what of it is committed is the
core's decision (core/proposer_rules.py).
"""

from __future__ import annotations

import array
import time
from typing import Any, NamedTuple

import msgspec
import torch

from specpage.core.request import TokenLogprobs
from specpage.core.span import Span
from specpage.core.step import NOTHING, SeqResult, SeqWork
from specpage.models.decoder import LayerTap
from specpage.speculation import logprobs
from specpage.speculation.acceptance import accept
from specpage.speculation.proposal import Proposal
from specpage.speculation.runner import TargetRunner
from specpage.speculation.sampler import Purpose, sample, uniform
from specpage.speculation.sampling_rows import (
    adjusted_rows,
    greedy_tokens,
    mask_rows_,
    row_probabilities,
    temperature_kernels,
)
from specpage.speculation.verdict import Verdict


class Verifier:
    def __init__(self, runner: TargetRunner, feature_layers: tuple[int, ...] = (),
                 coupled: bool = False) -> None:
        """coupled (engine.deterministic): a sampled row's token is the draw
        that sampling without speculation takes at its position (the seeded
        uniform, inverse CDF of the target's distribution), and a proposal
        is accepted while it equals those tokens, as greedy acceptance does
        with the argmax. Each position's token is then an exact sample of
        the target's distribution, the same with speculation on or off; a
        one-hot proposal x is accepted with probability p(x), as rejection
        sampling accepts it, a draft's distribution q less often than
        rejection sampling's sum of min(p, q)."""
        self.runner = runner
        self.feature_layers = feature_layers  # the target layers a draft head reads
        self.coupled = coupled

    def verify(self, batch: list[SeqWork], proposal: Proposal) -> Verdict:
        """Per sequence what it sampled, the forward's cost when it decoded
        only (None when it carried prefill), and the features a head reads."""
        if not batch:
            return Verdict([], None, None)
        spans = []
        for w, drafted in zip(batch, proposal.tokens, strict=True):
            logits_wanted = len(drafted) + 1 if w.sample else 0
            if w.prompt_logprobs >= 0:  # every position's, the prompt's rows first
                logits_wanted = len(w.tokens) + len(drafted)
            spans.append(Span(w.tokens + drafted, w.start, w.block_table, logits_wanted,
                              w.group_tables))
        # the head's features, unless it keeps nothing for any of them
        heads = bool(self.feature_layers) and any(w.draft_on for w in batch)
        tap = LayerTap(self.feature_layers) if heads else None
        start = time.perf_counter()
        logits = self.runner.forward(spans, tap)  # [sum of (k + 1) over sampling rows, vocab]
        seconds = time.perf_counter() - start
        # [positions of every span, layers * hidden]
        features = torch.cat(tap.states, dim=-1) if tap is not None else None
        decoding = all(w.sample and len(w.tokens) <= 2 for w in batch)
        cost = (sum(len(s.token_ids) for s in spans), seconds) if decoding else None
        results = [NOTHING] * len(batch)
        found: dict[int, list[TokenLogprobs]] = {}
        if any(w.prompt_logprobs >= 0 for w in batch):
            logits, found = _prompt_logprobs(batch, spans, logits)
        rows = [i for i, w in enumerate(batch) if w.sample]
        if rows:
            self._accept(batch, proposal, rows, logits, results)
        for i, prompt in found.items():
            results[i] = msgspec.structs.replace(results[i], prompt_logprobs=prompt)
        return Verdict(results, cost, features)

    def _accept(
        self,
        batch: list[SeqWork],
        proposal: Proposal,
        rows: list[int],
        logits: torch.Tensor,
        results: list[SeqResult],
    ) -> None:
        works = [batch[i] for i in rows]
        ks = [len(proposal.tokens[i]) for i in rows]
        offsets = [0]
        for k in ks:
            offsets.append(offsets[-1] + k + 1)  # logit rows of each sequence
        # what each row samples from; the log-probabilities stay the target's own
        adjusted = _with_history(works, [proposal.tokens[i] for i in rows], logits)
        # every row's argmax, for greedy acceptance (the grammars' masks then
        # correct those of the rows they change)
        argmax = (greedy_tokens(adjusted) if any(w.sampling.greedy for w in works)
                  else None)
        if any(w.allowed for w in works):
            adjusted = _with_grammar(works, ks, offsets, adjusted, logits, argmax)
        greedy = [r for r, w in enumerate(works) if w.sampling.greedy]
        sampled = [r for r, w in enumerate(works) if not w.sampling.greedy]
        num_accepted, next_token = [0] * len(rows), [0] * len(rows)
        decisions = []
        if greedy:
            decisions.append((greedy, self._greedy(
                [rows[r] for r in greedy], [ks[r] for r in greedy],
                [offsets[r] for r in greedy], proposal, argmax or [])))
        if sampled and self.coupled:
            decisions.append((sampled, self._coupled(
                [rows[r] for r in sampled], [works[r] for r in sampled],
                [ks[r] for r in sampled], [offsets[r] for r in sampled], proposal, adjusted)))
        elif sampled:
            decisions.append((sampled, self._sampled(
                [rows[r] for r in sampled], [works[r] for r in sampled],
                [ks[r] for r in sampled], [offsets[r] for r in sampled], proposal, adjusted)))
        for group, decided in decisions:
            for r, (a, token) in zip(group, decided, strict=True):
                num_accepted[r], next_token[r] = a, token
        log_probs = None
        if any(w.sampling.logprobs for w in works):
            log_probs = torch.log_softmax(logits, dim=-1)
        for r, (i, w, k) in enumerate(zip(rows, works, ks, strict=True)):
            a = num_accepted[r]
            new_tokens = proposal.tokens[i][:a] + [next_token[r]]
            chosen, top = [], []
            if log_probs is not None and w.sampling.logprobs:
                chosen = [float(log_probs[offsets[r] + j, t]) for j, t in enumerate(new_tokens)]
                if w.sampling.top_logprobs:
                    top = logprobs.top_of(log_probs[offsets[r] : offsets[r] + a + 1],
                                          w.sampling.top_logprobs)
            forks = self._fork_tokens(w, adjusted[offsets[r]]) if w.num_forks else []
            fork_logprobs = [float(log_probs[offsets[r], t]) for t in forks] if chosen else []
            results[i] = SeqResult(
                tokens=new_tokens,
                num_proposed=k,
                num_accepted=a,
                logprobs=chosen,
                fork_tokens=forks,
                fork_logprobs=fork_logprobs,
                top_logprobs=top,
                fork_top_logprobs=top[:1] * len(forks),
            )

    @staticmethod
    def _greedy(rows: list[int], ks: list[int], offsets: list[int], proposal: Proposal,
                argmax: list[int]) -> list[tuple[int, int]]:
        """Accept while the draft token equals the target's argmax (of every
        logit row)."""
        decided = []
        for i, k, base in zip(rows, ks, offsets, strict=True):
            a = 0
            while a < k and proposal.tokens[i][a] == argmax[base + a]:
                a += 1
            decided.append((a, argmax[base + a]))
        return decided

    @staticmethod
    def _coupled(rows: list[int], works: list[SeqWork], ks: list[int], offsets: list[int],
                 proposal: Proposal, logits: torch.Tensor) -> list[tuple[int, int]]:
        """Accept while the proposal equals the token sampling draws at its
        position (see __init__)."""
        index = torch.tensor([base + j for base, k in zip(offsets, ks, strict=True)
                              for j in range(k + 1)])
        row_params = [w.sampling for w, k in zip(works, ks, strict=True) for _ in range(k + 1)]
        draws = torch.tensor([uniform(w.sampling.seed, w.end + j, Purpose.SAMPLE)
                              for w, k in zip(works, ks, strict=True) for j in range(k + 1)],
                             dtype=torch.float64)
        drawn = sample(row_probabilities(logits[index], row_params), draws).tolist()
        decided = []
        start = 0
        for i, k in zip(rows, ks, strict=True):
            a = 0
            while a < k and proposal.tokens[i][a] == drawn[start + a]:
                a += 1
            decided.append((a, drawn[start + a]))
            start += k + 1
        return decided

    @staticmethod
    def _sampled(rows: list[int], works: list[SeqWork], ks: list[int], offsets: list[int],
                 proposal: Proposal, logits: torch.Tensor) -> list[tuple[int, int]]:
        """Lossless rejection sampling: against the draft's distributions
        where a proposal has them, else (no proposal, or proposals with no
        distribution) by _one_hot, or, where every row samples at a
        temperature alone, by the native kernels (_one_hot_native)."""
        one_hot = all(proposal.probs[i] is None for i, k in zip(rows, ks, strict=True) if k)
        kernels = temperature_kernels(logits, [w.sampling for w in works]) if one_hot else None
        if kernels is not None:
            return _one_hot_native(kernels, rows, works, ks, offsets, proposal, logits)
        index = torch.tensor([base + j for base, k in zip(offsets, ks, strict=True)
                              for j in range(k + 1)])
        row_params = [w.sampling for w, k in zip(works, ks, strict=True) for _ in range(k + 1)]
        target = row_probabilities(logits[index], row_params)
        if one_hot:
            return _one_hot(rows, works, ks, proposal, target)
        k_max = max(ks)
        vocab = logits.shape[-1]
        target_padded = torch.zeros(len(rows), k_max + 1, vocab)
        draft_padded = torch.ones(len(rows), k_max, vocab)
        draft_tokens = torch.zeros(len(rows), k_max, dtype=torch.int64)
        start = 0
        for r, (i, k) in enumerate(zip(rows, ks, strict=True)):
            target_padded[r, : k + 1] = target[start : start + k + 1]
            start += k + 1
            if k:
                draft_tokens[r, :k] = torch.tensor(proposal.tokens[i])
                probs = proposal.probs[i]
                if probs is None:  # proposed with certainty: q is one-hot
                    draft_padded[r, :k] = 0.0
                    draft_padded[r, torch.arange(k), draft_tokens[r, :k]] = 1.0
                else:
                    draft_padded[r, :k] = probs
        u_accept = torch.tensor(
            [[uniform(w.sampling.seed, w.end + j, Purpose.ACCEPT) for j in range(k_max)]
             for w in works], dtype=torch.float64,
        ).view(len(rows), k_max)  # fmt: skip
        u_next = torch.tensor(
            [[uniform(w.sampling.seed, w.end + a, Purpose.RESIDUAL if a < k else Purpose.SAMPLE)
              for a in range(k_max + 1)] for w, k in zip(works, ks, strict=True)],
            dtype=torch.float64,
        )  # fmt: skip
        result = accept(draft_tokens, draft_padded, target_padded, torch.tensor(ks), u_accept,
                        u_next)
        return list(zip(result.num_accepted, result.next_token, strict=True))

    @staticmethod
    def _fork_tokens(work: SeqWork, logits: torch.Tensor) -> list[int]:
        """First tokens of samples 1..n-1, drawn as each would draw its own."""
        probs = row_probabilities(logits[None], [work.sampling])[0]
        draws = torch.tensor(
            [uniform(work.sampling.seed + i, work.end, Purpose.SAMPLE)
             for i in range(1, work.num_forks + 1)],
            dtype=torch.float64,
        )
        return sample(probs.expand(work.num_forks, -1), draws).tolist()


class _Decided(NamedTuple):
    """What one-hot acceptance decided, per sequence: proposals accepted
    (also the row, of its k + 1, the next token is drawn from), the
    proposed token taken out of that row (-1: none) and the draw's uniform."""

    accepted: list[int]
    removed: list[int]
    draws: list[float]


def _decide(rows: list[int], works: list[SeqWork], ks: list[int], proposal: Proposal,
            p_at: list[float]) -> _Decided:
    """accept()'s tests with q one-hot at each proposed token x: x accepted
    where u < p(x) (p_at: the target's probability of each proposed token,
    sequence by sequence); at the first rejection the next token is drawn
    from p with x removed, renormalized, after the last proposal from p."""
    decided = _Decided([], [], [])
    seen = 0
    for i, w, k in zip(rows, works, ks, strict=True):
        seed, end = w.sampling.seed, w.end
        a = 0
        while a < k and uniform(seed, end + a, Purpose.ACCEPT) < p_at[seen + a]:
            a += 1
        seen += k
        decided.accepted.append(a)
        decided.removed.append(proposal.tokens[i][a] if a < k else -1)
        decided.draws.append(uniform(seed, end + a,
                                     Purpose.RESIDUAL if a < k else Purpose.SAMPLE))
    return decided


def _one_hot(rows: list[int], works: list[SeqWork], ks: list[int], proposal: Proposal,
             target: torch.Tensor) -> list[tuple[int, int]]:
    """_decide's acceptance with the same draws and the same arithmetic on
    the rows it reads as accept() on padded [rows, k, vocab] tensors, which
    at a vocabulary of 49,152 cost more than the target's probabilities
    themselves. target: each sequence's k + 1 rows of probabilities, in order."""
    first = [0]
    for k in ks:
        first.append(first[-1] + k + 1)
    proposed = [(first[r] + j, t) for r, i in enumerate(rows)
                for j, t in enumerate(proposal.tokens[i][: ks[r]])]
    p_at = (target[[at for at, _ in proposed], [t for _, t in proposed]].tolist()
            if proposed else [])
    decided = _decide(rows, works, ks, proposal, p_at)
    next_dist = target[[first[r] + a for r, a in enumerate(decided.accepted)]]
    removed = [(r, x) for r, x in enumerate(decided.removed) if x >= 0]
    if removed:
        at = torch.tensor([r for r, _ in removed])
        residual = next_dist[at]
        residual[torch.arange(len(removed)), [x for _, x in removed]] = 0.0
        mass = residual.sum(-1, keepdim=True)
        # p(x) = 1 leaves no residual mass; sampling p is then exact.
        next_dist[at] = torch.where(mass > 0, residual / mass.clamp(min=1e-30), next_dist[at])
    tokens = sample(next_dist, torch.tensor(decided.draws, dtype=torch.float64)).tolist()
    return list(zip(decided.accepted, tokens, strict=True))


def _one_hot_native(kernels: Any, rows: list[int], works: list[SeqWork], ks: list[int],
                    offsets: list[int], proposal: Proposal,
                    logits: torch.Tensor) -> list[tuple[int, int]]:
    """_decide's acceptance and its draw in one native call
    (kernels/cpu/sampling.cpp one_hot_acceptance): each sequence's rows
    weighed only as far as its tests reach, the seeded uniforms made there
    as sampler.uniform makes them, no row turned into a tensor of
    probabilities. Its arguments go as two buffers (torch.frombuffer over
    arrays: a microsecond each, where torch.tensor of a list takes several)."""
    meta = array.array("q", offsets)
    meta.extend(ks)
    meta.extend(_as_int64(w.sampling.seed) for w in works)
    meta.extend(w.end for w in works)
    for i, k in zip(rows, ks, strict=True):
        meta.extend(proposal.tokens[i][:k])
    inverse = array.array("f", [1.0 / w.sampling.temperature for w in works])
    decided = kernels.one_hot_acceptance(
        logits, torch.frombuffer(meta, dtype=torch.int64),
        torch.frombuffer(inverse, dtype=torch.float32)).tolist()
    return [(a, token) for a, token in decided]


def _as_int64(seed: int) -> int:
    """seed mod 2^64 as int64's two's complement: what sampler.uniform's
    arithmetic makes of it, in a tensor."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _prompt_logprobs(batch: list[SeqWork], spans: list[Span], logits: torch.Tensor,
                     ) -> tuple[torch.Tensor, dict[int, list[TokenLogprobs]]]:
    """The sampling rows of logits (the last k + 1 of each span that
    samples), and per sequence that asked (SeqWork.prompt_logprobs) the
    log-probabilities of the prompt tokens its other rows predict."""
    keep: list[int] = []  # the sampling rows, in order
    found: dict[int, list[TokenLogprobs]] = {}
    row = 0
    for i, (w, span) in enumerate(zip(batch, spans, strict=True)):
        if w.prompt_logprobs >= 0:
            # the newest token's row samples; the rows before it predict the prompt
            num_rows = len(w.tokens) - w.sample
            predicted = (w.tokens + [w.following])[1 : 1 + num_rows]
            found[i] = logprobs.of_tokens(logits[row : row + num_rows], predicted,
                                          w.prompt_logprobs)
            keep.extend(range(row + num_rows, row + span.num_logits))
        else:
            keep.extend(range(row, row + span.num_logits))
        row += span.num_logits
    index = torch.tensor(keep, dtype=torch.int64, device=logits.device)
    return logits.index_select(0, index), found


def _with_history(works: list[SeqWork], proposed: list[list[int]],
                  logits: torch.Tensor) -> torch.Tensor:
    """The logits [sum of (k + 1), vocab] adjusted by each sample's history
    (speculation/sampling_rows.py): row j of a sequence as if its first j
    proposals were accepted, so that the target's p at every row is the one
    plain decoding would sample from there, and acceptance stays lossless."""
    if all(w.sampling.adjustments is None for w in works):
        return logits
    rows, num_tokens, added = [], [], []
    for w, drafted in zip(works, proposed, strict=True):
        for j in range(len(drafted) + 1):
            rows.append(w.sampling)
            num_tokens.append(w.end + j)
            added.append(drafted[:j])
    return adjusted_rows(logits, rows, num_tokens, added)


def _with_grammar(works: list[SeqWork], ks: list[int], offsets: list[int],
                  adjusted: torch.Tensor, logits: torch.Tensor,
                  argmax: list[int] | None) -> torch.Tensor:
    """adjusted with every token a constrained sequence's grammar forbids at
    a row set to -inf (SeqWork.allowed: the grammar's state after the
    proposal's prefix before the row), so that greedy, sampled and forked
    tokens all come from what the grammar allows; argmax (every row's,
    given when a row is greedy) corrected where a mask changes it.

    A greedy row whose argmax the grammar allows keeps it under the mask
    (argmax takes the first of equal values: every token before it is
    smaller), so only the other rows are masked; a model that follows the
    format leaves few. `logits` itself is masked in place when no row
    reports log-probabilities (they are the target's own, before the mask),
    else left as it is."""
    masked: list[int] = []  # rows to lay a mask on
    masks: list[bytes] = []
    for w, k, base in zip(works, ks, offsets[: len(works)], strict=True):
        if not w.allowed:
            continue
        size = len(w.allowed) // (k + 1)  # bytes per row
        lazy = argmax is not None and w.sampling.greedy and not w.num_forks
        for j in range(k + 1):
            mask = w.allowed[j * size : (j + 1) * size]
            if lazy:
                token = argmax[base + j]  # type: ignore[index]
                if token >> 3 < size and mask[token >> 3] >> (token & 7) & 1:
                    continue
            masked.append(base + j)
            masks.append(mask)
    if not masked:
        return adjusted
    if adjusted is logits and any(w.sampling.logprobs for w in works):
        adjusted = logits.clone()
    mask_rows_(adjusted, masked, b"".join(masks))
    if argmax is not None:
        index = torch.tensor(masked, device=adjusted.device)
        rows = greedy_tokens(adjusted.index_select(0, index))
        for row, token in zip(masked, rows, strict=True):
            argmax[row] = token
    return adjusted
