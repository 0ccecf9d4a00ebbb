"""How many tokens to speculate: a fixed k, or k chosen each step from the
measured acceptance and the measured cost of draft and target forwards.

With per-token acceptance a, k proposals yield (1 - a^(k+1)) / (1 - a) tokens
per step on average. They cost k more target positions and a row in each of k
draft forwards. While the target is bandwidth-bound, extra positions are
nearly free; on a CPU with a batch they are not, and a draft forward that
runs for one sequence costs nearly what it costs for all. Each sequence picks
the k in 0..k_max that gives the most expected tokens per second of its share
of the step (see `SpecPolicy._step_seconds`); alone in the batch that is the step's tokens per
second.

Costs are curves of seconds against the positions a forward computes,
measured by the engine at start-up for both models and corrected online, size
by size, by the forwards actually run (a start-up measurement on a busy
machine can be off by half or more at any size). Target forwards that carry
prefill chunks are left out of the correction: a prompt's positions cost far
more each than verified ones. Until the draft has run or been measured, its
cost is a prior fraction of the target step.

A draft model does not run for a sequence that does not speculate; the
first forward after such a stretch catches it up on the positions it missed
(core/proposer_rules.py), and that forward is priced at its size, which
grows with the lag (docs/BENCHMARKS.md); the first proposal after a prompt
catches up on all of it.

A step that speculates costs more than its forwards' curves say: the
target's verify runs on caches the draft just filled, and the proposer has
work around its forwards (an EAGLE-3 head absorbs, carries state). The
executor reports each step's whole time, and what speculating steps take
beyond their forwards' prices, over what plain steps take beyond theirs,
is priced as a cost of speculating in a step (`SpecPolicy.unpriced`; what
it came to with the EAGLE-3 head: docs/BENCHMARKS.md).

An EAGLE-3 head costs a sequence something every step even while it does
not speculate (core/proposer_rules.py; measured in docs/BENCHMARKS.md).
So while speculation does not pay for a new sequence at the batch it joins,
the head is left off it for its whole life (`admits_draft`), except for
one new sequence in HEAD_PROBE_EVERY, which keeps measuring acceptance and
costs so that the head comes back once it pays. Only where some k would pay
at PROBE_ACCEPTANCE, though: a batch so large that even a head that good
would not speculate learns nothing from a probe, and pays for it
(docs/BENCHMARKS.md).

The choice of k only learns what the sizes it runs cost, so a sequence now and
then tries one proposal more than pays (a probe): a size priced too high at
start-up is measured and corrected instead of avoided for good. A probe's
loss (its step's cost beyond what its expected tokens are worth at the best
k's rate) is kept to PROBE_BUDGET of the sequence's time by spacing probes.

Pure Python; imports no torch.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NamedTuple

from specpage.core.model_free import (
    LEAST_SHARE,
    NO_SPECULATION,
    Candidate,
    Method,
    Speculation,
)
from specpage.core.payoff import Payoff
from specpage.core.proposer_rules import ProposerRules
from specpage.core.request import Request, Sequence

# Observations of one curve point whose least is its correction (as the
# start-up measurement keeps the least of its repeats). Other work on the
# machine only ever adds time, to forwards of every size alike, and k is
# chosen from costs relative to each other: sizes run at busy moments and at
# quiet ones compare best by their quiet ones. A slow forward moves nothing;
# a size found cheaper counts at once, a size grown costlier after WINDOW
# forwards. (A busy machine stretches forwards many times over, for several
# forwards at a time: docs/BENCHMARKS.md.)
WINDOW = 16
# Forwards of a curve after which a size not run since is stale: its
# correction is then capped by that of the nearest size run since, so that
# when the whole machine gets faster (its memory rate doubles within
# minutes on some hosts) the sizes no longer run follow it down. Else a
# size last run in a slow spell keeps its slow cost against sizes measured
# in the fast one, and k stays where that comparison puts it. Capped only
# downwards, as a size never run: a stale size that looks no costlier than
# measured gets tried, and then corrected.
STALE = WINDOW
# Tokens between probes (one proposal more than pays): while a sequence does
# not speculate, often while speculation pays at the shared acceptance (on a
# CPU, verifying 2 positions costs about as much as 1); otherwise, and at any
# k below k_max, rarely, so that a useless draft costs little. The rare period
# is per sequence and grows with the batch (PROBE_IDLE · batch): a probe costs
# a draft forward and a target position whatever the batch, so the probes of
# all sequences together stay about as few per step as for one sequence
# alone. (Probes as frequent at a large batch as alone cost throughput for
# speculation that does not pay there: docs/BENCHMARKS.md.)
PROBE_EVERY = 4
PROBE_IDLE = 16
# The share of a sequence's time that probes may lose, by spacing them
# further apart than PROBE_IDLE · batch where they cost more, up to
# PROBE_MOST tokens apart. (A probe after a long stretch without proposals
# costs the draft's catch-up and a verified position: docs/BENCHMARKS.md.)
PROBE_BUDGET = 0.02
PROBE_MOST = 1024
# Acceptance is estimated from counts of accepted and tested proposals,
# decayed per observation, shrunk towards a prior by a pseudo-count: a few
# rejections are enough to turn a useless draft off.
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 1.0  # tested proposals the prior is worth against all sequences' history
SEQ_WEIGHT = 4.0  # tested proposals the shared estimate is worth against a sequence's own
DECAY = 0.97  # all sequences, per observation
LONG_DECAY = 0.999  # all sequences, per observation: what a new sequence can expect
SEQ_DECAY = 0.9  # one sequence, per observation
GAIN_TO_START = 1.05  # speculation must promise this much over k = 0 (unmodelled costs)
# Steps of each kind (speculating, plain) whose time beyond their forwards'
# prices is kept; the unpriced cost is the difference of the two medians,
# once each kind has UNPRICED_LEAST steps (speculating ones can be rare).
UNPRICED_WINDOW = 16
UNPRICED_LEAST = 4
# While a head does not pay, one new sequence in this many keeps it, where
# some k would pay at PROBE_ACCEPTANCE.
HEAD_PROBE_EVERY = 8
PROBE_ACCEPTANCE = 0.9
# A model-free proposal's chances (learned over all sequences by the evidence
# of each token: core/chance.py) are scaled per sequence by how many tokens
# verification accepted of its own proposals over how many they promised,
# shrunk towards 1 by SEQ_WEIGHT promised tokens.
# A seeded sample's model-free proposal keeps the tokens at least this
# likely by their confidences alone: its tokens depend on what it proposes,
# so the choice may not depend on measured costs or on other requests.
SEEDED_CHANCE = 0.5
# SpecPolicy._cached_seconds' entries kept at most.
CACHED_MOST = 256
# Keys of SpecPolicy._cached_seconds beside a draft's lag (>= 0).
MODEL_FREE = -1
LONGEST_PAYING = -2
LEAST_CHANCE = -3


class MethodCounts:
    """What one proposal method drafted and verification accepted."""

    __slots__ = ("drafted", "accepted", "accepted_by_position")

    def __init__(self, positions: int) -> None:
        self.drafted = 0
        self.accepted = 0
        self.accepted_by_position = [0] * positions  # acceptances at proposal 1..positions


class CostCurve:
    """Seconds of one forward against the positions it computes.

    A piecewise-linear curve through measured points (made non-decreasing;
    past the last point it continues along the last segment). The engine
    measures the points when it starts (`calibrate`): forwards run at one
    batch size for long stretches, so a curve fitted online alone would
    extrapolate its slope from positions it has barely seen, and the slope is
    what decides whether extra positions pay.

    Each point is then corrected by the forwards actually run near it: its
    scale is the least of the last WINDOW ratios of observed to measured
    seconds there. A point not run yet takes the scale of the nearest point
    run in the last STALE forwards, when that is below 1 (the machine is
    faster than measured), and otherwise keeps its start-up measurement: a
    size that looks no costlier than measured gets tried, and then
    corrected, where one that looked costlier on a busy moment might never
    be run again. A point run, but not in the last STALE forwards, keeps its
    own scale or takes that nearest point's, whichever is less.
    """

    def __init__(self, points: Seq[tuple[float, float]]) -> None:
        if not points:
            raise ValueError("a cost curve needs at least one measured point")
        self.points: list[tuple[float, float]] = []
        for items, seconds in sorted(points):
            if self.points and items == self.points[-1][0]:
                continue
            floor = self.points[-1][1] if self.points else 0.0
            self.points.append((float(items), max(float(seconds), floor)))
        self._xs = [x for x, _ in self.points]
        self._ys = [y for _, y in self.points]
        self._logs = [math.log(max(x, 1e-9)) for x in self._xs]
        # per point, the latest ratios of observed to measured seconds
        self._ratios: list[deque[float]] = [deque(maxlen=WINDOW) for _ in self._xs]
        self._least: list[float | None] = [None] * len(self._xs)  # min of each window
        self._last_run = [-1] * len(self._xs)  # the observation that last ran each point
        self._corrected = list(self._ys)
        self.observations = 0

    @classmethod
    def line(cls, fixed: float, per_item: float) -> CostCurve:
        return cls([(1, fixed + per_item), (2, fixed + 2 * per_item)])

    def base(self, items: float) -> float:
        """The measured curve, without the online correction."""
        return _interpolate(self._xs, self._ys, items)

    def __call__(self, items: float) -> float:
        return _interpolate(self._xs, self._corrected, items)

    def scale(self, items: float) -> float:
        """The online correction at this size: corrected over measured."""
        return self(items) / max(self.base(items), 1e-12)

    def observe(self, items: int, seconds: float) -> bool:
        """A forward of this size took these seconds; whether the corrected
        curve changed. It depends only on each point's least ratio and on
        which points ran in the last STALE forwards, so where neither moved
        (most forwards: a window's least stays until a cheaper one comes or
        it leaves) nothing is recomputed."""
        self.observations += 1
        nearest = self._nearest(items)
        ratios = self._ratios[nearest]
        ratios.append(seconds / max(self.base(items), 1e-12))
        lowest = min(ratios)  # the one window that changed
        moved = (lowest != self._least[nearest]  # its least, or it joins the recent points
                 or self._last_run[nearest] < self.observations - STALE)
        self._least[nearest] = lowest
        self._last_run[nearest] = self.observations
        if not moved and self.observations - STALE not in self._last_run:
            return False  # (nor did a point leave the recent ones)
        before = list(self._corrected)
        # each point's least ratio where it ran in the last STALE forwards
        recent = [least if last > self.observations - STALE else None
                  for least, last in zip(self._least, self._last_run, strict=True)]
        fresh = [(log, least) for log, least in zip(self._logs, recent, strict=True)
                 if least is not None]
        floor, j = 0.0, 0  # j: the fresh point nearest to the point at hand
        for i, (log, measured) in enumerate(zip(self._logs, self._ys, strict=True)):
            least, own = self._least[i], recent[i]
            if own is not None:
                scale = own
            else:
                # (points ascend, so the nearest fresh one only moves on; of two
                # as near, the first)
                while j + 1 < len(fresh) and abs(fresh[j + 1][0] - log) < abs(fresh[j][0] - log):
                    j += 1
                scale = min(1.0 if least is None else least, fresh[j][1])
            floor = max(floor, measured * scale)
            self._corrected[i] = floor
        return self._corrected != before

    def _nearest(self, items: float) -> int:
        """The point nearest to items, on a log scale (1 and 2 are as far
        apart as 32 and 64)."""
        log = math.log(max(items, 1e-9))
        i = bisect.bisect_left(self._logs, log)
        if i == len(self._logs) or (i > 0 and log - self._logs[i - 1] < self._logs[i] - log):
            return i - 1
        return i


def _interpolate(xs: list[float], ys: list[float], items: float) -> float:
    i = bisect.bisect_left(xs, items)  # the first point at or past items
    if i == 0 or len(xs) == 1:
        return ys[0]
    i = min(i, len(xs) - 1)  # past the last point: along the last segment
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (items - xs[i - 1]) / (xs[i] - xs[i - 1])


def shrunk(accepted: float, tested: float, prior: float, weight: float) -> float:
    return (accepted + weight * prior) / (tested + weight)


def expected_tokens(acceptance: float, k: int) -> float:
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


# Priors in units of a target decode step, until the engine has measured
# both models: the draft costs a tenth of it, each extra target position a
# hundredth.
PRIOR_TARGET = (1.0, 0.01)
PRIOR_DRAFT = (0.1, 0.001)


class SpecPolicy:
    def __init__(self, k_max: int, rules: ProposerRules, adaptive: bool = True,
                 model_free_k: int = 0) -> None:
        """rules: the draft's (core/proposer_rules.py), which say what its lag
        costs a proposal and whether it costs a sequence it does not propose
        for; NO_MODEL without a draft."""
        self.k_max = k_max
        self.rules = rules
        self.adaptive = adaptive
        self.model_free_k = model_free_k  # model-free proposals at most (0: none)
        self.by_method = {method: MethodCounts(max(k_max, model_free_k)) for method in Method}
        self.recent_accepted = 0.0  # decayed counts over all sequences
        self.recent_tested = 0.0
        self.long_accepted = 0.0  # the same, decayed far more slowly
        self.long_tested = 0.0
        self.target_cost = CostCurve.line(*PRIOR_TARGET)
        self.draft_cost = CostCurve.line(*PRIOR_DRAFT)
        self.calibrated = False
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_tested = 0  # proposals whose predecessors were all accepted
        self.last_k = 0.0  # mean k of the last step's decoding sequences
        self.last_drafting = 0.0  # the share of them that speculated
        self.accepted_by_position = [0] * k_max  # acceptances at proposal 1..k_max
        # (batch, lag) -> _step_seconds, until what they are priced on changes
        self._seconds: dict[tuple[int, int], list[float]] = {}
        self._bases: dict[int, StepBases] = {}  # by batch: what _step_seconds prices by lag
        self._prior_seconds = step_seconds(k_max, 1, CostCurve.line(*PRIOR_TARGET),
                                           CostCurve.line(*PRIOR_DRAFT), 1, 0)
        # seconds beyond their forwards' prices, of plain and speculating steps
        self._excess: dict[bool, deque[float]] = {
            speculated: deque(maxlen=UNPRICED_WINDOW) for speculated in (False, True)}
        self.unpriced = 0.0  # seconds a step takes for speculating beyond its forwards
        self.num_admitted = 0  # new sequences asked about
        self.num_without_draft = 0  # of them, those a head was left off
        self.payoff = Payoff()  # whether model-free steps paid, by batch (core/payoff.py)

    @property
    def max_proposals(self) -> int:
        """Proposals a sequence may make in a step, by any method."""
        return max(self.k_max, self.model_free_k)

    def calibrate(self, target: list[tuple[int, float]], draft: list[tuple[int, float]]) -> None:
        """Measured (positions, seconds) of target and draft forwards (none
        without a draft model)."""
        self.target_cost = CostCurve(target)
        if draft:
            self.draft_cost = CostCurve(draft)
        self.calibrated = True
        self._seconds.clear()
        self._bases.clear()

    @property
    def acceptance(self) -> float:
        """Per-token acceptance over all sequences, recent history weighted most."""
        return shrunk(self.recent_accepted, self.recent_tested, PRIOR_ACCEPTANCE, PRIOR_WEIGHT)

    @property
    def expected_acceptance(self) -> float:
        """What a new sequence can expect: per-token acceptance over all
        sequences over a far longer history than `acceptance`, which
        follows the sequences running now (one stream's last request says
        little of the next one's)."""
        return shrunk(self.long_accepted, self.long_tested, PRIOR_ACCEPTANCE, PRIOR_WEIGHT)

    def admits_draft(self, request: Request, batch: int) -> bool:
        """Whether the draft keeps KV for a new sequence of request, joining
        a batch of this size: always for a draft that costs nothing while it
        does not propose (a draft model: it does not run) and with a fixed
        k; for a request whose k is forced, when it is not 0; for a request
        that samples with a seed (its output must not depend on the load);
        otherwise a head where some k pays at the expected acceptance, and
        for one new sequence in HEAD_PROBE_EVERY where some k would pay at
        PROBE_ACCEPTANCE."""
        if not self.rules.costs_while_idle or not self.adaptive or self.k_max == 0:
            return True
        if request.spec_k is not None:
            return request.spec_k > 0
        params = request.params
        if params.seed is not None and not params.greedy:
            return True
        self.num_admitted += 1
        seconds = self._cached_seconds(max(batch, 1), 0)
        if _best_k(self.expected_acceptance, seconds) > 0:
            return True
        if (self.num_admitted % HEAD_PROBE_EVERY == 1
                and _best_k(PROBE_ACCEPTANCE, seconds) > 0):
            return True
        self.num_without_draft += 1
        return False

    def choose_k(self, seq: Sequence, batch: int) -> int:
        if not seq.draft_on:
            return 0
        forced = seq.request.spec_k
        if forced is not None:
            return min(forced, self.k_max)
        if not self.adaptive or self.k_max == 0:
            return self.k_max
        batch = max(batch, 1)
        acceptance = shrunk(seq.accepted, seq.tested, self.acceptance, SEQ_WEIGHT)
        shared = self.acceptance
        params = seq.request.params
        if params.seed is not None and not params.greedy:
            # A seeded sampled request's samples depend on k; choose it from
            # the request's own history and the priors only, so its output is
            # the same whatever else runs and however long forwards take.
            # (A greedy token is the target's argmax at its position, seed
            # or none; k changes only which forward computes it, so a greedy
            # request is priced like any other. On CPU the forward's shape
            # changes its floating-point sums, and a near-tie can flip.)
            acceptance = shared = shrunk(seq.accepted, seq.tested, PRIOR_ACCEPTANCE, SEQ_WEIGHT)
            batch, seconds = 1, self._prior_seconds
        else:
            seconds = self._cached_seconds(batch, self.rules.priced_lag(seq))
        best_k = _best_k(acceptance, seconds)
        # Now and then probe with one proposal more, so that acceptance and
        # the cost of the next size keep being measured and speculation can
        # come back or grow: rarely at any k (a step adds 1..best_k + 1
        # tokens, so a window that wide is entered at least once a period),
        # and often while a sequence does not speculate but speculation pays
        # at the acceptance shared by all sequences.
        if (best_k < self.k_max
                and seq.num_tokens % self._probe_period(acceptance, seconds, best_k, batch)
                <= best_k):
            return best_k + 1
        if best_k == 0 and seq.num_tokens % PROBE_EVERY == 0 and _best_k(shared, seconds) > 0:
            return 1
        return best_k

    def speculate(self, seq: Sequence, batch: int, candidate: Candidate | None) -> Speculation:
        """This step's proposals for seq: none, the draft's k, or as much of
        a model-free candidate as pays, whichever promises the most expected
        tokens per second of seq's share of the step. A forced k keeps the
        draft where there is one; a seeded sample chooses without costs."""
        k = self.choose_k(seq, batch)
        forced = seq.request.spec_k
        if candidate is None or forced == 0:
            return Speculation(k)
        params = seq.request.params
        if forced is not None or not self.adaptive:
            if self.k_max:
                return Speculation(k)
            return self._model_free(candidate, len(candidate.tokens) if forced is None
                                    else forced)
        if params.seed is not None and not params.greedy:
            if k:
                return Speculation(k)
            return self._model_free(candidate,
                                    sum(c >= SEEDED_CHANCE for c in candidate.chance))
        chance = self._chance(seq, candidate)
        batch = max(batch, 1)
        seconds = self._cached_seconds(batch, MODEL_FREE)
        length, rate = _best_length(chance, seconds)
        if k:
            acceptance = shrunk(seq.accepted, seq.tested, self.acceptance, SEQ_WEIGHT)
            drafted = self._cached_seconds(batch, self.rules.priced_lag(seq))
            if expected_tokens(acceptance, k) / drafted[k] >= rate:
                return Speculation(k)
        return self._model_free(candidate, length)

    def model_free_lookup(self, seq: Sequence, batch: int) -> tuple[int, float, float]:
        """How far the proposers need look for seq in a batch of this size:
        the longest model-free proposal that could pay, were every token
        sure to be accepted (none need be looked up beyond it: at a large
        batch on a CPU, a few), and the least chance of acceptance its first
        token can have, as the proposer finds it (before seq's own scale,
        `_chance`), for any of those lengths to be worth verifying. With a
        first chance c, length L promises at most 1 + L c tokens for its
        seconds, and below the floor no L promises what `_best_length` takes
        over none: the proposer walks no further after such a token (at a
        large batch on a CPU, most of what it finds). The floor is 0 where
        proposals are not priced (a forced k, a fixed policy, a seeded
        sample). Third, seq's own scale of the proposer's chances: its
        walks end at a later token LEAST_SHARE turns down (`_best_length`)."""
        if seq.request.spec_k is not None or not self.adaptive:
            return (self.model_free_k if seq.request.spec_k != 0 else 0), 0.0, 1.0
        params = seq.request.params
        if params.seed is not None and not params.greedy:
            return self.model_free_k, 0.0, 1.0  # chosen by confidences alone
        if not self.payoff.allows(batch):
            return 0, 0.0, 1.0
        length = int(self._cached_seconds(max(batch, 1), LONGEST_PAYING)[0])
        if not length:
            return 0, 0.0, 1.0
        floor = self._cached_seconds(max(batch, 1), LEAST_CHANCE)[length - 1]
        if floor <= 0:
            return length, 0.0, 1.0
        scale = shrunk(seq.model_free_accepted, seq.model_free_expected, 1.0, SEQ_WEIGHT)
        # (a hair below, so that rounding never turns down a token that pays)
        return length, floor * (1 - 1e-9) / scale if scale > 0 else math.inf, scale

    @staticmethod
    def _model_free(candidate: Candidate, length: int) -> Speculation:
        length = min(length, len(candidate.tokens))
        if length <= 0:
            return NO_SPECULATION
        return Speculation(length, tuple(candidate.tokens[:length]), candidate.method,
                           sum(candidate.chance[:length]), tuple(candidate.evidence[:length]))

    @staticmethod
    def _chance(seq: Sequence, candidate: Candidate) -> list[float]:
        """The candidate's chances of acceptance, scaled by how seq's own
        model-free proposals were accepted against their chances."""
        scale = shrunk(seq.model_free_accepted, seq.model_free_expected, 1.0, SEQ_WEIGHT)
        return [min(1.0, c * scale) for c in candidate.chance]

    def _probe_period(self, acceptance: float, seconds: list[float], best_k: int,
                      batch: int) -> int:
        """probe_period once the draft has run, PROBE_IDLE · batch until then:
        the start-up measurement alone can be off by half or more."""
        if not self.draft_cost.observations:
            return PROBE_IDLE * batch
        return probe_period(acceptance, seconds, best_k, batch)

    def _cached_seconds(self, batch: int, lag: int) -> list[float]:
        """_step_seconds, kept until what it is priced on changes; lag
        MODEL_FREE: _model_free_seconds; LONGEST_PAYING: [the length
        model_free_lookup gives]; LEAST_CHANCE: model_free_lookup's floor
        for each length 1..model_free_k."""
        seconds = self._seconds.get((batch, lag))
        if seconds is None:
            if lag == LEAST_CHANCE:
                priced = self._cached_seconds(batch, MODEL_FREE)
                seconds, least = [], math.inf
                for length in range(1, len(priced)):
                    pays = (GAIN_TO_START * priced[length] / priced[0] - 1) / length
                    if length > 1:  # tokens of one chance c pass LEAST_SHARE up to here
                        room = 1 - LEAST_SHARE * (length - 1)  # (none past 100 tokens)
                        pays = max(pays, LEAST_SHARE / room if room > 0 else math.inf)
                    least = min(least, pays)
                    seconds.append(least)
            elif lag == LONGEST_PAYING:
                sure = [1.0] * self.model_free_k
                seconds = [float(_best_length(sure, self._cached_seconds(batch, MODEL_FREE))[0])]
            elif lag == MODEL_FREE:
                seconds = self._model_free_seconds(batch)
            else:
                seconds = self._step_seconds(batch, lag)
            if len(self._seconds) >= CACHED_MOST:  # (a draft's lag grows while it idles)
                self._seconds.clear()
            self._seconds[batch, lag] = seconds
        return seconds

    def _model_free_seconds(self, batch: int) -> list[float]:
        """Seconds of a sequence's share of the step for each model-free
        proposal length 0..model_free_k: only target positions, priced alone
        (what its proposals add to the step's positions) or together (a step
        in which every sequence proposes as many), the cheaper."""
        target = self.target_cost
        positions = batch + (batch - 1) * self.last_k
        share = target(batch) / batch
        return [share] + [min(share + target(positions + n) - target(positions),
                              target(batch * (n + 1)) / batch)
                          for n in range(1, self.model_free_k + 1)]

    def _step_seconds(self, batch: int, lag: int = 0) -> list[float]:
        """Seconds of a sequence's share of the step for each k in 0..k_max,
        in a batch of this size with the other sequences proposing as they
        did last step, for a sequence whose first proposal's draft forward
        catches up on `lag` positions (the rules' priced_lag).
        Its share without proposals is 1/batch of the target forward.
        Proposals are priced two ways and the cheaper counts:
        - alone: what its k adds to the step as the others run it (the extra
          target positions where the step's positions are, and a row in each
          of k draft forwards, lag + 1 rows in the first; a whole draft
          forward when no other sequence drafts). Speculating then pays when
          the tokens it adds come faster than the batch's own.
        - together: 1/batch of a step in which every sequence proposes k, so
          that a draft forward worth running for all is started even when
          none runs yet.
        Alone in the batch both are the step's seconds.
        """
        bases = self._bases.get(batch)
        if bases is None:
            target, draft = self.target_cost, self.draft_cost
            if not (self.calibrated or draft.observations):
                step = target(1) / sum(PRIOR_TARGET)  # a target step, in seconds
                draft = CostCurve.line(*(step * part for part in PRIOR_DRAFT))
            others = batch - 1
            positions = batch + others * self.last_k  # before this sequence's proposals
            m = others * self.last_drafting  # other sequences that run through the draft
            bases = self._bases[batch] = step_bases(self.k_max, batch, target, draft,
                                                    positions, m)
        # (a draft that idles lags a position more each step: its prices follow
        # from the same bases)
        return lagged_seconds(bases, lag, self.unpriced)

    def observe_costs(
        self, target: tuple[int, float] | None, drafts: list[tuple[int, float]]
    ) -> None:
        """(positions, seconds) of this step's target forward, None when it
        carried prefill, and of each draft forward."""
        changed = False
        if target is not None and target[0] > 0:
            changed = self.target_cost.observe(*target)
        for draft in drafts:
            if draft[0] > 0:
                changed = self.draft_cost.observe(*draft) or changed
        if changed:
            self._seconds.clear()
            self._bases.clear()

    def observe_step_seconds(self, speculated: bool, target: tuple[int, float] | None,
                             drafts: list[tuple[int, float]], seconds: float) -> None:
        """The executor's whole time for a decoding step (target: its forward,
        None when it carried prefill), before its costs are observed; whether
        a sequence proposed in it. Updates `unpriced`."""
        if target is None or target[0] <= 0 or seconds <= 0:
            return
        priced = self.target_cost(target[0]) + sum(self.draft_cost(n) for n, _ in drafts if n > 0)
        self._excess[speculated].append(seconds - priced)
        plain, speculating = self._excess[False], self._excess[True]
        if min(len(plain), len(speculating)) >= UNPRICED_LEAST:
            unpriced = max(0.0, statistics.median(speculating) - statistics.median(plain))
            if unpriced != self.unpriced:
                self.unpriced = unpriced
                # (only a draft's steps price it, and after their bases)
                self._forget(lambda batch, lag: lag >= 0, bases=False)

    def observe_payoff(self, batch: int, model_free: bool, tokens: int, seconds: float) -> None:
        """A decoding step's outcome (core/payoff.py): its batch, whether a
        model-free proposal was verified in it, the tokens it made and its
        whole time, scheduling included."""
        self.payoff.observe(batch, model_free, tokens, seconds, self.target_cost(batch))

    def observe_step(self, ks: list[int], drafting: int | None = None) -> None:
        """The k of each decoding sequence of the step just run, and how many
        of them the draft proposed for (all that proposed, if not given)."""
        if ks:
            last = self.last_k, self.last_drafting
            self.last_k = sum(ks) / len(ks)
            self.last_drafting = (sum(k > 0 for k in ks) if drafting is None
                                  else drafting) / len(ks)
            if (self.last_k, self.last_drafting) != last:
                # what the other sequences propose: nothing to one alone in its batch
                self._forget(lambda batch, lag: batch > 1)

    def _forget(self, priced_by: Callable[[int, int], bool], bases: bool = True) -> None:
        """Drop the cached seconds of the (batch, lag) keys priced_by says
        depend on what just changed, and with bases the step bases of
        those batches."""
        for key in [key for key in self._seconds if priced_by(*key)]:
            del self._seconds[key]
        if bases:
            for batch in [batch for batch in self._bases if priced_by(batch, 0)]:
                del self._bases[batch]

    def observe_acceptance(self, seq: Sequence, proposed: int, accepted: int,
                           speculation: Speculation | None = None) -> None:
        """What verification kept of seq's proposals, as speculation (the
        draft's when not given) proposed them."""
        if proposed == 0:
            return
        method = speculation.method if speculation is not None else Method.DRAFT
        counts = self.by_method[method]
        counts.drafted += proposed
        counts.accepted += accepted
        for position in range(accepted):
            counts.accepted_by_position[position] += 1
        self.num_drafted += proposed
        self.num_accepted += accepted
        if method is Method.GRAMMAR:
            return  # the grammar's forced tokens say nothing of any proposer's chances
        if method is not Method.DRAFT:
            assert speculation is not None
            expected = speculation.expected
            seq.model_free_accepted = seq.model_free_accepted * SEQ_DECAY + accepted
            seq.model_free_expected = seq.model_free_expected * SEQ_DECAY + expected
            return
        # Proposals are tested until the first rejection: a per-token rate is
        # accepted over tested, not over proposed.
        tested = accepted + (accepted < proposed)
        seq.accepted = seq.accepted * SEQ_DECAY + accepted
        seq.tested = seq.tested * SEQ_DECAY + tested
        self.recent_accepted = self.recent_accepted * DECAY + accepted
        self.recent_tested = self.recent_tested * DECAY + tested
        self.long_accepted = self.long_accepted * LONG_DECAY + accepted
        self.long_tested = self.long_tested * LONG_DECAY + tested
        self.num_tested += tested
        for position in range(accepted):
            self.accepted_by_position[position] += 1


class StepBases(NamedTuple):
    """What step_seconds prices that does not depend on a sequence's lag:
    its share of the step without proposals, and for each k in 1..k_max
    its proposals alone and together, before the lag's catch-up and the
    unpriced cost; and what pricing the lag needs (the draft's curve, the
    batch, the sequences drafting)."""

    share: float
    alone: list[float]
    together: list[float]
    draft: CostCurve
    batch: int
    drafting: float


def step_bases(k_max: int, batch: int, target: CostCurve, draft: CostCurve,
               positions: float, drafting: float) -> StepBases:
    share = target(batch) / batch
    draft_row = draft(drafting + 1) - (draft(drafting) if drafting >= 1
                                        else drafting * draft(1))
    alone, together = [], []
    for k in range(1, k_max + 1):
        alone.append(share + target(positions + k) - target(positions) + k * draft_row)
        together.append(target(batch * (k + 1)) + k * draft(batch))
    return StepBases(share, alone, together, draft, batch, drafting)


def lagged_seconds(bases: StepBases, lag: int, unpriced: float) -> list[float]:
    """step_seconds from its bases (the same sums, in the same order)."""
    draft, batch, drafting = bases.draft, bases.batch, bases.drafting
    catch_up = draft(drafting + 1 + lag) - draft(drafting + 1)  # the lag's rows, first forward
    caught_up = draft(batch * (1 + lag)) - draft(batch)  # every sequence's, together
    alone_unpriced = max(0.0, 1.0 - drafting) * unpriced
    return [bases.share] + [min(alone + catch_up + alone_unpriced,
                                (together + caught_up + unpriced) / batch)
                            for alone, together in zip(bases.alone, bases.together, strict=True)]


def step_seconds(k_max: int, batch: int, target: CostCurve, draft: CostCurve,
                 positions: float, drafting: float, lag: int = 0,
                 unpriced: float = 0.0) -> list[float]:
    """See SpecPolicy._step_seconds; unpriced: what a step costs for
    speculating beyond its forwards, paid alone by a sequence that
    speculates where no other does."""
    return lagged_seconds(step_bases(k_max, batch, target, draft, positions, drafting), lag,
                          unpriced)


def probe_period(acceptance: float, seconds: list[float], best_k: int, batch: int) -> int:
    """Tokens between probes (best_k + 1 proposals) for a sequence at best_k:
    PROBE_IDLE · batch, or further apart where a probe would lose more than
    PROBE_BUDGET of the time its tokens take at best_k's rate."""
    per_token = seconds[best_k] / expected_tokens(acceptance, best_k)
    loss = seconds[best_k + 1] - expected_tokens(acceptance, best_k + 1) * per_token
    period = PROBE_IDLE * batch
    if loss > 0:
        period = max(period, math.ceil(loss / (PROBE_BUDGET * per_token)))
    return min(period, PROBE_MOST)


def _best_length(chance: list[float], seconds: list[float]) -> tuple[int, float]:
    """The model-free proposal length with the most expected tokens per
    second (1 + the chances of the tokens proposed), and that rate; 0
    unless another length clearly beats it, as for k. No token after the
    first whose chance is below LEAST_SHARE of the tokens before it."""
    best, best_rate, tokens = 0, 1.0 / seconds[0], 1.0
    for length, p in enumerate(chance[: len(seconds) - 1], start=1):
        if length > 1 and p < LEAST_SHARE * tokens:
            break
        tokens += p
        rate = tokens / seconds[length]
        if rate > best_rate * (GAIN_TO_START if best == 0 else 1.01):
            best, best_rate = length, rate
    return best, best_rate


def _best_k(acceptance: float, seconds: list[float]) -> int:
    """The k with the most expected tokens per second; k = 0 unless another
    k clearly beats it."""
    best_k, best_rate = 0, 0.0
    for k, spent in enumerate(seconds):
        rate = expected_tokens(acceptance, k) / spent
        # prefer the smaller k on a near tie, and k = 0 unless clearly beaten
        if rate > best_rate * (GAIN_TO_START if best_k == 0 else 1.01):
            best_k, best_rate = k, rate
    return best_k
