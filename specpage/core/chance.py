"""How often verification accepts a model-free proposal's token, by the
evidence it was found on.

A token found after a long n-gram of the context is accepted far more
often than one found after a single token, and a follower seen three
times more often than one seen once: in a replay of the target's own
greedy answers to bench/workloads' grounded requests (n-grams up to 6), a
follower seen once was accepted 0.6 of the time after a 2-gram and 0.94
after a 6-gram, where its count alone says 2/3 for both. So each token's chance of acceptance (given
that the tokens before it were accepted) is learned per (method, whether
the request samples, Evidence) from what verification did with earlier
tokens of that kind (a sampled request accepts a token with the target's
probability of it, a greedy one only where it is the likeliest): accepted over
tested, decayed, shrunk towards the token's own prior (its count's share,
core/ngram.py) by PRIOR_WEIGHT pseudo-tests. Only the tokens verification
tested count: those up to and including the first rejected one.

Pure Python; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from specpage.core.ngram import Evidence

PRIOR_WEIGHT = 4.0  # tests the prior is worth
DECAY = 0.999  # per test of the same kind: the table follows a workload that changes

Kind = tuple[str, bool, Evidence]  # (method, sampled, evidence)


class ChanceTable:
    __slots__ = ("tests",)

    def __init__(self) -> None:
        self.tests: dict[Kind, tuple[float, float]] = {}  # kind -> (accepted, tested), decayed

    def chance(self, kind: Kind, prior: float) -> float:
        """The chance that a token of this kind is accepted, given the ones before."""
        accepted, tested = self.tests.get(kind, (0.0, 0.0))
        return (accepted + prior * PRIOR_WEIGHT) / (tested + PRIOR_WEIGHT)

    def chain(self, method: str, sampled: bool, evidence: Seq[Evidence],
              priors: Seq[float]) -> list[float]:
        """Per token: the chance that it and every token before it are accepted."""
        chain, out = 1.0, []
        for found, prior in zip(evidence, priors, strict=True):
            chain *= self.chance((method, sampled, found), prior)
            out.append(chain)
        return out

    def observe(self, method: str, sampled: bool, evidence: Seq[Evidence],
                accepted: int) -> None:
        """Verification accepted the first `accepted` of these tokens (and
        rejected the next, if there is one)."""
        for position, found in enumerate(evidence[: accepted + 1]):
            kind = (method, sampled, found)
            hits, tested = self.tests.get(kind, (0.0, 0.0))
            self.tests[kind] = (hits * DECAY + (position < accepted), tested * DECAY + 1.0)
