"""How many tokens to speculate: a fixed k, or k chosen each step from the
measured acceptance and the measured cost of draft and target forwards.

With per-token acceptance a, k proposals yield (1 - a^(k+1)) / (1 - a) tokens
per step on average. A step costs k draft forwards over batch positions plus
one target forward over batch · (k + 1) positions; while the target is
bandwidth-bound the extra positions are nearly free, and as the batch grows
they are not. The policy picks the k in 0..k_max with the most expected
tokens per second.

Costs are fitted per forward against the positions it computed. Target
forwards that carry prefill chunks are left out of the fit: a prompt's
positions cost far more each than verified ones. Until the draft has run,
its cost is a prior fraction of the measured target step.

Pure Python; imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specpage.request import Sequence

EMA = 0.1  # weight of the newest cost observation
# Tokens between probes (one proposal) while a sequence does not speculate:
# often while speculation pays at the shared acceptance (on a CPU, verifying 2
# positions costs about as much as 1), rarely otherwise, so that a useless
# draft costs little. The rare period is per sequence and grows with the
# batch (PROBE_IDLE · batch): a probe costs a draft forward and a target
# position whatever the batch, so the probes of all sequences together stay
# about as few per step as for one sequence alone. (At 32 streams, probes
# every 16 tokens each cost 6-12% of throughput with a good draft, for
# speculation that does not pay at that batch.)
PROBE_EVERY = 4
PROBE_IDLE = 16
# Acceptance is estimated from counts of accepted and tested proposals,
# decayed per observation, shrunk towards a prior by a pseudo-count: a few
# rejections are enough to turn a useless draft off.
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 1.0  # tested proposals the prior is worth against all sequences' history
SEQ_WEIGHT = 4.0  # tested proposals the shared estimate is worth against a sequence's own
DECAY = 0.97  # all sequences, per observation
SEQ_DECAY = 0.9  # one sequence, per observation
GAIN_TO_START = 1.05  # speculation must promise this much over k = 0 (unmodelled costs)


@dataclass
class LinearCost:
    """seconds ≈ fixed + per_item · items, fitted with exponentially weighted
    least squares; starts from a prior."""

    fixed: float
    per_item: float
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, x, y, xx, xy
    observations: int = 0

    def observe(self, items: int, seconds: float) -> None:
        self.observations += 1
        w, x, y, xx, xy = (s * (1 - EMA) for s in self.sums)
        self.sums = [w + 1, x + items, y + seconds, xx + items * items, xy + items * seconds]
        w, x, y, xx, xy = self.sums
        spread = xx * w - x * x
        if w > 3 and spread > 1e-9 * max(1.0, xx * w):
            self.per_item = max(0.0, (xy * w - x * y) / spread)
            self.fixed = max(0.0, (y - self.per_item * x) / w)
        else:  # one batch size seen so far: keep the slope, move the level
            self.fixed = max(0.0, y / w - self.per_item * x / w)

    def __call__(self, items: float) -> float:
        return self.fixed + self.per_item * items


def shrunk(accepted: float, tested: float, prior: float, weight: float) -> float:
    return (accepted + weight * prior) / (tested + weight)


def expected_tokens(acceptance: float, k: int) -> float:
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


# Priors in units of a target decode step: the draft costs a tenth of it,
# each extra target position a hundredth.
PRIOR_TARGET = LinearCost(fixed=1.0, per_item=0.01)
PRIOR_DRAFT = LinearCost(fixed=0.1, per_item=0.001)


class SpecPolicy:
    def __init__(self, k_max: int, adaptive: bool = True) -> None:
        self.k_max = k_max
        self.adaptive = adaptive
        self.recent_accepted = 0.0  # decayed counts over all sequences
        self.recent_tested = 0.0
        self.target_cost = LinearCost(PRIOR_TARGET.fixed, PRIOR_TARGET.per_item)
        self.draft_cost = LinearCost(PRIOR_DRAFT.fixed, PRIOR_DRAFT.per_item)
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_tested = 0  # proposals whose predecessors were all accepted
        self.last_k = 0.0  # mean k of the last step
        self.accepted_by_position = [0] * k_max  # acceptances at proposal 1..k_max

    @property
    def acceptance(self) -> float:
        """Per-token acceptance over all sequences, recent history weighted most."""
        return shrunk(self.recent_accepted, self.recent_tested, PRIOR_ACCEPTANCE, PRIOR_WEIGHT)

    def choose_k(self, seq: Sequence, batch: int) -> int:
        forced = seq.request.spec_k
        if forced is not None:
            return min(forced, self.k_max)
        if not self.adaptive or self.k_max == 0:
            return self.k_max
        batch = max(batch, 1)
        acceptance = shrunk(seq.accepted, seq.tested, self.acceptance, SEQ_WEIGHT)
        target_cost, draft_cost = self.target_cost, self.draft_cost
        if not draft_cost.observations:  # the prior, in units of a target step
            unit = target_cost(batch) if target_cost.observations else 1.0
            draft_cost = LinearCost(PRIOR_DRAFT.fixed * unit, PRIOR_DRAFT.per_item * unit)
        shared = self.acceptance
        if seq.request.params.seed is not None:
            # A seeded request's samples depend on k; choose it from the
            # request's own history and fixed costs only, so its output is
            # the same whatever else runs and however long forwards take.
            acceptance = shared = shrunk(seq.accepted, seq.tested, PRIOR_ACCEPTANCE, SEQ_WEIGHT)
            batch, target_cost, draft_cost = 1, PRIOR_TARGET, PRIOR_DRAFT
        best_k = self._best_k(acceptance, batch, target_cost, draft_cost)
        # Now and then probe with one proposal, so acceptance keeps being
        # measured and speculation can come back: often while speculation
        # pays at the acceptance shared by all sequences, rarely otherwise
        # (a useless draft, or a batch where extra positions are not free).
        # (PROBE_IDLE · batch is a multiple of PROBE_EVERY: the shared choice is only
        # worked out on the tokens where it decides.)
        if best_k == 0 and seq.num_tokens % PROBE_EVERY == 0 and (
            seq.num_tokens % (PROBE_IDLE * batch) == 0
            or self._best_k(shared, batch, target_cost, draft_cost) > 0
        ):
            return 1
        return best_k

    def _best_k(self, acceptance: float, batch: int, target_cost: LinearCost,
                draft_cost: LinearCost) -> int:
        """The k with the most expected tokens per second."""
        best_k, best_rate = 0, 0.0
        for k in range(self.k_max + 1):
            seconds = k * draft_cost(batch) + target_cost(batch * (k + 1))
            rate = expected_tokens(acceptance, k) / seconds
            # prefer the smaller k on a near tie, and k = 0 unless clearly beaten
            if rate > best_rate * (GAIN_TO_START if best_k == 0 else 1.01):
                best_k, best_rate = k, rate
        return best_k

    def observe_costs(
        self, target: tuple[int, float] | None, drafts: list[tuple[int, float]]
    ) -> None:
        """(positions, seconds) of this step's target forward, None when it
        carried prefill, and of each draft forward."""
        if target is not None and target[0] > 0:
            self.target_cost.observe(*target)
        for draft in drafts:
            if draft[0] > 0:
                self.draft_cost.observe(*draft)

    def observe_acceptance(self, seq: Sequence, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        # Proposals are tested until the first rejection: a per-token rate is
        # accepted over tested, not over proposed.
        tested = accepted + (accepted < proposed)
        seq.accepted = seq.accepted * SEQ_DECAY + accepted
        seq.tested = seq.tested * SEQ_DECAY + tested
        self.recent_accepted = self.recent_accepted * DECAY + accepted
        self.recent_tested = self.recent_tested * DECAY + tested
        self.num_drafted += proposed
        self.num_accepted += accepted
        self.num_tested += tested
        for position in range(accepted):
            self.accepted_by_position[position] += 1
