"""The speculation policy alone (pure Python): acceptance bookkeeping, cost
fits and the choice of k."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpage.core.policy import (
    HEAD_PROBE_EVERY,
    PRIOR_DRAFT,
    PRIOR_TARGET,
    PROBE_ACCEPTANCE,
    PROBE_BUDGET,
    PROBE_EVERY,
    PROBE_IDLE,
    STALE,
    UNPRICED_LEAST,
    WINDOW,
    CostCurve,
    SpecPolicy,
    _best_k,
    expected_tokens,
    probe_period,
    step_seconds,
)
from specpage.core.proposer_rules import DRAFT_MODEL, HEAD, ProposerRules
from specpage.core.request import Request, SamplingParams, Sequence


def sequence(num_tokens: int = 5, **params) -> Sequence:
    request = Request("r", (1, 2, 3), SamplingParams(max_tokens=64, **params))
    seq = Sequence(0, request, 0, [1, 2, 3] + [9] * (num_tokens - 3))
    request.sequences.append(seq)
    return seq


def cheap_draft_policy() -> SpecPolicy:
    policy = SpecPolicy(k_max=6, rules=DRAFT_MODEL)
    # a bandwidth-bound target, a draft a tenth of its cost
    policy.calibrate([(1, 0.050), (5, 0.055)], [(1, 0.005), (2, 0.0051)])
    return policy


def cpu_like_policy() -> SpecPolicy:
    """Each target position costs a tenth of the fixed part, as on a CPU;
    the draft's forward costs mostly its fixed part."""
    policy = SpecPolicy(k_max=4, rules=DRAFT_MODEL)
    policy.calibrate([(1, 0.045), (64, 0.360)], [(1, 0.005), (64, 0.020)])
    return policy


def seasoned(policy: SpecPolicy, accepted: int, proposed: int = 4, times: int = 20) -> SpecPolicy:
    for _ in range(times):
        policy.observe_acceptance(sequence(), proposed=proposed, accepted=accepted)
    return policy


def test_per_token_acceptance_counts_only_tested_proposals():
    policy = SpecPolicy(k_max=4, rules=DRAFT_MODEL)
    seq = sequence()
    policy.observe_acceptance(seq, proposed=4, accepted=2)  # 3 tested: 2 kept, 1 rejected
    policy.observe_acceptance(seq, proposed=4, accepted=4)  # all 4 tested and kept
    policy.observe_acceptance(seq, proposed=0, accepted=0)  # no speculation: ignored
    assert (policy.num_drafted, policy.num_accepted, policy.num_tested) == (8, 6, 7)
    assert policy.accepted_by_position == [2, 2, 1, 1]


def test_a_cost_curve_interpolates_its_points_and_follows_the_forwards_run():
    cost = CostCurve([(16, 0.130), (1, 0.050), (4, 0.065)])
    assert cost(1) == cost(0.5) == pytest.approx(0.050)
    assert cost(2) == pytest.approx(0.055)
    assert cost(10) == pytest.approx(0.0975)
    assert cost(28) == pytest.approx(0.195)  # past the last point, along the last segment
    for _ in range(3):  # the machine got 20% slower: forwards of every size say so
        for n in (1, 4, 16):
            cost.observe(n, 1.2 * cost.base(n))
    assert [cost.scale(n) for n in (1, 2, 4, 8, 16, 28)] == pytest.approx([1.2] * 6)
    assert cost(4) == pytest.approx(1.2 * 0.065)
    assert cost.observations == 9


def test_a_cost_curve_measured_half_off_is_corrected_size_by_size_by_one_forward_each():
    """Start-up points off by -50% and +50% (a busy machine): each size's
    first forward corrects it, so the slope between sizes comes right too."""
    true = {1: 0.050, 2: 0.050, 5: 0.060, 16: 0.100}
    cost = CostCurve([(1, 0.025), (2, 0.075), (5, 0.030), (16, 0.150)])
    for n in (1, 2, 5, 16):
        cost.observe(n, true[n])
    assert [cost(n) for n in true] == pytest.approx(list(true.values()))
    assert cost(3) == pytest.approx(0.050 + 0.010 / 3)  # between corrected points


def test_a_slow_forward_moves_no_cost_and_a_lasting_change_takes_over_after_a_window():
    cost = CostCurve([(1, 0.040), (4, 0.050)])
    for seconds in (0.040, 0.400, 0.040):  # the machine busy for one forward
        cost.observe(1, seconds)
    assert cost(1) == pytest.approx(0.040)
    cost.observe(1, 0.030)  # cheaper: at once
    assert cost(1) == pytest.approx(0.030)
    seen = []
    for _ in range(WINDOW):  # then 50% costlier for good
        cost.observe(1, 0.045)
        seen.append(cost(1))
    assert seen == pytest.approx([0.030] * (WINDOW - 1) + [0.045])


def test_a_size_not_run_yet_follows_the_nearest_size_run_only_down():
    """A size no forward ran takes the correction of the nearest size that
    ran when it is below 1 (the machine is faster than measured); above 1 it
    keeps its start-up cost, so that it looks no costlier than measured and
    gets tried."""
    cost = CostCurve([(1, 0.040), (2, 0.040), (16, 0.120), (64, 0.400)])
    cost.observe(1, 0.020)  # half the measured cost
    cost.observe(64, 0.600)  # 1.5 times
    assert [cost.scale(n) for n in (1, 2, 16, 64)] == pytest.approx([0.5, 0.5, 1.0, 1.5])


def test_expected_tokens_matches_the_geometric_sum():
    assert expected_tokens(0.5, 4) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    assert expected_tokens(0.0, 4) == 1.0


def test_fixed_k_and_a_request_cap():
    assert SpecPolicy(k_max=4, rules=DRAFT_MODEL, adaptive=False).choose_k(sequence(), batch=1) == 4
    capped = sequence()
    capped.request.spec_k = 2
    assert SpecPolicy(k_max=4, rules=DRAFT_MODEL).choose_k(capped, batch=1) == 2


def test_adaptive_k_speculates_when_it_pays():
    policy = cheap_draft_policy()
    seq = sequence()
    for _ in range(10):
        policy.observe_acceptance(seq, proposed=4, accepted=3)
    assert policy.acceptance > 0.7
    assert policy.choose_k(sequence(), batch=1) >= 3  # a new sequence starts from the shared rate


def test_a_useless_draft_is_turned_off_within_a_few_steps():
    policy = cheap_draft_policy()
    seq = sequence(num_tokens=PROBE_IDLE + 1)
    k = [policy.choose_k(seq, batch=1)]
    assert k[0] > 0  # the prior is optimistic
    while k[-1] > 0 and len(k) < 8:
        policy.observe_acceptance(seq, proposed=k[-1], accepted=0)
        k.append(policy.choose_k(seq, batch=1))
    assert k[-1] == 0, k
    # a new sequence starts from the shared rate: one proposal at most, then off
    new = sequence(num_tokens=PROBE_IDLE + 5)
    assert policy.choose_k(new, batch=1) <= 1
    policy.observe_acceptance(new, proposed=1, accepted=0)
    assert policy.choose_k(new, batch=1) == 0
    # and now and then one probe keeps acceptance measured: rarely, as the
    # draft is useless for every sequence
    assert policy.choose_k(sequence(num_tokens=PROBE_EVERY), batch=1) == 0
    assert policy.choose_k(sequence(num_tokens=PROBE_IDLE), batch=1) == 1


def test_a_sequence_the_draft_fails_probes_often_while_it_pays_for_the_others():
    policy = SpecPolicy(k_max=6, rules=DRAFT_MODEL)
    # a draft a quarter of the target's cost
    policy.calibrate([(1, 0.050), (5, 0.055)], [(1, 0.012), (2, 0.0121)])
    for _ in range(20):
        policy.observe_acceptance(sequence(), proposed=4, accepted=3)
    unlucky = sequence(num_tokens=PROBE_EVERY + 1)
    for _ in range(40):
        policy.observe_acceptance(unlucky, proposed=1, accepted=0)
    assert policy.choose_k(unlucky, batch=1) == 0
    unlucky.token_ids.extend([9] * (PROBE_EVERY - 1))
    assert unlucky.num_tokens % PROBE_EVERY == 0 and unlucky.num_tokens % PROBE_IDLE
    assert policy.choose_k(unlucky, batch=1) == 1


def test_idle_probes_thin_out_as_the_batch_grows():
    """Probes cost a draft forward and a target position whatever the batch:
    where speculation does not pay, a sequence in a batch of B probes every
    PROBE_IDLE · B tokens, so all of them together probe about as often per
    step as one sequence alone."""
    policy = SpecPolicy(k_max=4, rules=DRAFT_MODEL)
    # compute-bound: each extra target position costs a lot
    policy.calibrate([(1, 0.040), (32, 0.150), (64, 0.270)], [(2, 0.004), (32, 0.008)])
    for _ in range(20):
        policy.observe_acceptance(sequence(), proposed=1, accepted=1)
        policy.observe_acceptance(sequence(), proposed=1, accepted=0)
    assert 0.4 < policy.acceptance < 0.6
    speculating = {batch: sum(policy.choose_k(sequence(num_tokens=n), batch=batch) > 0
                              for n in range(3, 3 + 1024))
                   for batch in (1, 8, 32)}
    assert speculating[1] == 1024  # alone, speculation pays at this acceptance
    probes = {batch: n for batch, n in speculating.items() if batch > 1}
    assert probes[8] == 1024 // (PROBE_IDLE * 8)
    assert probes[32] == 1024 // (PROBE_IDLE * 32)


def test_a_seeded_request_chooses_k_from_its_own_history_only():
    policy = cheap_draft_policy()
    for _ in range(20):
        policy.observe_acceptance(sequence(), proposed=4, accepted=0)
    seeded = sequence(seed=5, temperature=0.8)
    alone = SpecPolicy(k_max=6, rules=DRAFT_MODEL).choose_k(sequence(seed=5, temperature=0.8),
                                                            batch=1)
    assert policy.choose_k(seeded, batch=32) == alone > 0


def test_before_the_draft_has_run_its_cost_is_a_fraction_of_the_measured_target_step():
    """Priors are in units of a target step: a 40 ms target does not make a
    draft that has not run yet look like 0.1 s."""
    policy = SpecPolicy(k_max=4, rules=DRAFT_MODEL)
    for _ in range(10):
        policy.observe_costs((1, 0.040), [])
        policy.observe_costs((3, 0.042), [])
    seq = sequence()
    for _ in range(5):
        policy.observe_acceptance(seq, proposed=4, accepted=2)
    assert policy.draft_cost.observations == 0
    assert policy.choose_k(seq, batch=1) >= 2


def test_a_slow_catch_up_forward_does_not_price_every_proposal():
    """Draft costs are a curve against positions: one long catch-up forward
    (16 positions) among one-position proposal forwards leaves the
    per-proposal cost at the latter."""
    policy = SpecPolicy(k_max=4, rules=DRAFT_MODEL)
    policy.calibrate([(1, 0.040), (2, 0.041)], [(1, 0.003), (16, 0.008)])
    for _ in range(20):
        policy.observe_costs((1, 0.040), [(16, 0.008), (1, 0.003), (1, 0.003)])
    assert policy.draft_cost(1) == pytest.approx(0.003, rel=1e-6)


def test_alone_in_the_batch_k_is_the_one_with_the_most_tokens_per_second_of_the_step():
    policy = seasoned(cpu_like_policy(), accepted=2)  # 2 of 3 tested: a = 2/3
    target, draft = policy.target_cost, policy.draft_cost
    a = policy.acceptance
    rates = [expected_tokens(a, k) / (target(1 + k) + k * draft(1)) for k in range(5)]
    best = max(range(5), key=rates.__getitem__)
    assert best > 0 and rates[best] > 1.05 * rates[0]
    assert policy.choose_k(sequence(), batch=1) == best


def test_speculation_that_pays_alone_does_not_pay_in_a_batch_where_positions_cost():
    """On a CPU an extra target position costs about a tenth of a decode step:
    alone, k > 0 pays; in a batch of 16 the same proposals cost more than the
    tokens they add, whether or not the others draft."""
    policy = seasoned(cpu_like_policy(), accepted=2)
    assert policy.choose_k(sequence(), batch=1) > 0
    assert policy.choose_k(sequence(num_tokens=5), batch=16) == 0
    policy.observe_step([2] * 16)  # every other sequence drafted last step
    assert policy.choose_k(sequence(num_tokens=5), batch=16) == 0


def test_a_lone_drafter_pays_for_a_whole_draft_forward():
    """A draft forward costs nearly the same for one row as for the batch.
    With a nearly free target and a draft forward of 40% of it, a sequence
    the draft serves poorly does not start one alone, but adds its row when
    the others draft anyway."""
    policy = SpecPolicy(k_max=2, rules=DRAFT_MODEL)
    policy.calibrate([(1, 0.050), (64, 0.082)], [(1, 0.020), (64, 0.0263)])
    for i in range(30):  # 3 proposals in 10 kept
        policy.observe_acceptance(sequence(), proposed=1, accepted=int(i % 10 < 3))
    assert 0.25 < policy.acceptance < 0.4
    policy.observe_step([0] * 8)
    assert policy.choose_k(sequence(num_tokens=5), batch=8) == 0
    policy.observe_step([1] * 8)
    assert policy.choose_k(sequence(num_tokens=5), batch=8) > 0


def test_a_draft_forward_worth_running_for_all_starts_when_none_runs():
    """Priced alone, the first drafter would pay a whole draft forward; the
    step where every sequence drafts is better, so speculation starts."""
    policy = SpecPolicy(k_max=2, rules=DRAFT_MODEL)
    policy.calibrate([(1, 0.050), (64, 0.082)], [(1, 0.005), (64, 0.0113)])
    seasoned(policy, accepted=1, proposed=2)  # a = 1/2
    policy.observe_step([0] * 8)
    assert policy.choose_k(sequence(num_tokens=5), batch=8) > 0


def test_a_seeded_greedy_request_is_priced_like_an_unseeded_one():
    """Greedy tokens do not depend on k, so a seed changes nothing: both are
    priced with the measured costs. (Priced with the priors, where extra
    positions cost a hundredth of a step, the seeded one would speculate.)"""
    policy = seasoned(cpu_like_policy(), accepted=2)
    for batch, speculates in ((1, True), (16, False)):
        ks = {policy.choose_k(sequence(num_tokens=5, temperature=0.0, seed=seed), batch)
              for seed in (None, 3)}
        assert len(ks) == 1 and (ks.pop() > 0) == speculates
    sampled = sequence(num_tokens=5, temperature=0.8, seed=3)
    assert policy.choose_k(sampled, batch=16) > 0  # a seeded sampled request: the priors


def test_a_speculating_sequence_now_and_then_tries_one_proposal_more():
    """So that the cost of the next size is measured: a size priced too high
    at start-up is corrected rather than avoided for good. A step adds up to
    k + 1 tokens, so the window where it probes is k + 1 tokens wide."""
    policy = seasoned(cpu_like_policy(), accepted=2)
    best = policy.choose_k(sequence(num_tokens=5), batch=1)
    assert 0 < best < policy.k_max
    ks = [policy.choose_k(sequence(num_tokens=n), batch=1) for n in range(16, 48)]
    assert ks == [best + 1 if n % PROBE_IDLE <= best else best for n in range(16, 48)]


def test_a_size_no_longer_run_follows_the_machine_down():
    """The machine's memory rate doubles while every forward runs at one
    size: a size last run in the slow spell must not keep its slow cost
    against the size run since, or the comparison between them (the choice
    of k) is decided by when each was run. Upwards it keeps its own, as a
    size never run: looking cheaper, it gets tried and corrected."""
    cost = CostCurve([(32, 0.100), (64, 0.150)])
    for _ in range(WINDOW):  # slow spell: k = 0, 32 positions, as measured
        cost.observe(32, 0.100)
    for _ in range(STALE - 1):  # every sequence speculates, in a fast spell
        cost.observe(64, 0.075)
    assert cost(32) == pytest.approx(0.100)  # not stale yet
    cost.observe(64, 0.075)
    assert cost(32) == pytest.approx(0.050) and cost(64) == pytest.approx(0.075)
    for _ in range(WINDOW):  # a slower spell than measured: 32 keeps its own
        cost.observe(64, 0.300)
    assert cost(32) == pytest.approx(0.100) and cost(64) == pytest.approx(0.300)


def lagging(num_tokens: int, lag: int) -> Sequence:
    """A sequence whose target holds all but its newest token and whose
    draft lacks the last `lag` of those."""
    seq = sequence(num_tokens=num_tokens)
    seq.num_computed = num_tokens - 1
    seq.num_draft_computed = seq.num_computed - lag
    return seq


def q4_like_policy(rules: ProposerRules = DRAFT_MODEL) -> SpecPolicy:
    """Costs as SmolLM2-135M q4 and its 4-layer draft measured on a 2-core
    CPU: a 3.4 ms step, each verified position 0.4 ms more, a draft forward
    0.9 ms at one position and 2.8 ms catching up on 16 (as it did on the
    reference attention)."""
    policy = SpecPolicy(k_max=4, rules=rules)
    policy.calibrate([(1, 0.0034), (2, 0.0038), (5, 0.0048)],
                     [(1, 0.0009), (8, 0.0011), (17, 0.0028)])
    return policy


def test_a_lagging_draft_prices_its_catch_up():
    """A draft that has missed 16 positions catches up in the forward of its
    first proposal: at acceptance 0.5 one proposal pays for a draft that is
    current, and not for one that must first catch up."""
    policy = seasoned(q4_like_policy(), accepted=1, proposed=2, times=40)
    assert 0.45 < policy.acceptance < 0.55
    current, behind = lagging(37, lag=0), lagging(37, lag=16)
    assert policy.choose_k(current, batch=1) >= 1
    assert policy.choose_k(behind, batch=1) == 0
    seconds = policy._step_seconds(1, 16)
    assert seconds[1] - policy._step_seconds(1, 0)[1] == pytest.approx(
        policy.draft_cost(17) - policy.draft_cost(1))
    assert seconds[0] == policy._step_seconds(1, 0)[0]  # without proposals it does not run


def test_costly_probes_are_spaced_to_lose_at_most_the_budget():
    """Where a probe (one proposal more than pays) costs more than its
    tokens are worth, probes come far enough apart that they lose at most
    PROBE_BUDGET of the sequence's time; a cheap probe keeps PROBE_IDLE.
    (Only once the draft has run: until then its cost is the start-up
    measurement's, which can be off by half.)"""
    policy = seasoned(q4_like_policy(), accepted=0, proposed=1, times=40)
    assert policy.acceptance < 0.1
    assert policy.choose_k(lagging(PROBE_IDLE, lag=0), batch=1) == 1
    policy.observe_costs(None, [(1, 0.0009)])
    for lag in (0, 15):
        seconds = policy._step_seconds(1, lag)
        period = probe_period(policy.acceptance, seconds, 0, 1)
        loss = seconds[1] - expected_tokens(policy.acceptance, 1) * seconds[0]
        assert loss > 0 and period > PROBE_IDLE
        assert loss / period <= PROBE_BUDGET * seconds[0] * 1.0001
        assert loss / (period - 1) > PROBE_BUDGET * seconds[0]  # no further apart than that
        probes = sum(policy.choose_k(lagging(n, lag), batch=1) > 0 for n in range(3, 3 + 4096))
        assert probes == pytest.approx(4096 / period, abs=1)
    cheap = seasoned(cheap_draft_policy(), accepted=0, proposed=1, times=40)
    cheap.observe_costs(None, [(1, 0.005)])
    assert probe_period(cheap.acceptance, cheap._step_seconds(1), 0, 1) == PROBE_IDLE


def test_a_head_prices_k_forwards_and_no_catch_up():
    """An EAGLE-3 head makes k proposals in k forwards, as a draft model
    does: the forward that absorbs the accepted positions leaves the state
    its next first proposal projects. Its lag is absorbed when the block
    fills whether it proposes or not, so catching up is not priced: a head
    that stopped proposing for a step is not kept from starting again."""
    priced = {}
    for rules in (DRAFT_MODEL, HEAD):
        policy = seasoned(q4_like_policy(rules), accepted=1, proposed=2, times=40)
        current = lagging(37, lag=0)
        assert policy.choose_k(current, batch=1) >= 1
        seconds = policy._step_seconds(1, 0)
        assert seconds[2] - seconds[1] == pytest.approx(
            policy.target_cost(3) - policy.target_cost(2) + policy.draft_cost(1))
        priced[rules] = seconds
        behind = lagging(37, lag=15)
        assert policy._step_seconds(1, 15)[1] > seconds[1]  # what a lag of 15 would cost
        if rules is HEAD:
            behind.draft_state = b"carried states"  # a head's lag is what it carries
            assert (rules.draft_lag(behind), rules.priced_lag(behind)) == (15, 0)
            assert policy.choose_k(behind, batch=1) == policy.choose_k(current, batch=1)
        else:
            assert (rules.draft_lag(behind), rules.priced_lag(behind)) == (15, 15)
    assert priced[HEAD] == pytest.approx(priced[DRAFT_MODEL])


def test_what_speculating_steps_take_beyond_their_forwards_is_priced():
    """A step that speculates can take more than its forwards' prices (the
    verify runs on caches the draft just filled): the policy learns how much
    more than a plain step does beyond its own, once it has seen
    UNPRICED_LEAST steps of each, and adds it to every k that speculates.
    At acceptance 0.5 one proposal then no longer pays."""
    policy = seasoned(q4_like_policy(), accepted=1, proposed=2, times=40)
    seq = lagging(37, lag=0)
    assert policy.choose_k(seq, batch=1) == 1
    before = policy._step_seconds(1, 0)
    priced = policy.target_cost(2) + policy.draft_cost(1)
    policy.observe_step_seconds(False, None, [], 0.050)  # a prefill step: not a decode's
    for _ in range(UNPRICED_LEAST):
        policy.observe_step_seconds(False, (1, 0.0034), [], policy.target_cost(1) + 0.0002)
        assert policy.unpriced == 0.0
        policy.observe_step_seconds(True, (2, 0.0040), [(1, 0.0009)], priced + 0.0022)
    assert policy.unpriced == pytest.approx(0.002)
    after = policy._step_seconds(1, 0)
    assert after[0] == before[0]
    assert after[1:] == pytest.approx([b + 0.002 for b in before[1:]])
    assert policy.choose_k(seq, batch=1) == 0
    # speculating steps as cheap as priced again: nothing more to pay
    for _ in range(16):
        policy.observe_step_seconds(True, (2, 0.0040), [(1, 0.0009)], priced + 0.0001)
    assert policy.unpriced == 0.0
    assert policy._step_seconds(1, 0) == pytest.approx(before)


def request(**params) -> Request:
    return Request("r", (1, 2, 3), SamplingParams(max_tokens=64, **params))


def test_a_head_that_does_not_pay_is_left_off_new_sequences_but_one_in_so_many():
    """A head costs a sequence every step, speculating or not; a draft model
    costs nothing where it does not run. So while no k pays, a head is left
    off new sequences, except one in HEAD_PROBE_EVERY that keeps measuring;
    a sequence it was left off never speculates, forced k or not."""
    head = seasoned(q4_like_policy(HEAD), accepted=0, proposed=1, times=40)
    admitted = [head.admits_draft(request(), batch=1) for _ in range(2 * HEAD_PROBE_EVERY)]
    assert admitted == ([True] + [False] * (HEAD_PROBE_EVERY - 1)) * 2
    assert head.num_without_draft == 2 * (HEAD_PROBE_EVERY - 1)
    # a forced k (0: no head), or a seeded sample (whose output must not depend on the load)
    assert head.admits_draft(Request("r", (1,), SamplingParams(), spec_k=2), batch=1)
    assert not head.admits_draft(Request("r", (1,), SamplingParams(), spec_k=0), batch=1)
    assert head.admits_draft(request(temperature=1.0, seed=3), batch=1)
    assert head.admits_draft(request(), batch=1)  # the next probe
    assert not head.admits_draft(request(temperature=0.0, seed=3), batch=1)  # greedy: any k
    draft = seasoned(q4_like_policy(DRAFT_MODEL), accepted=0, proposed=1, times=40)
    assert all(draft.admits_draft(request(), batch=1) for _ in range(HEAD_PROBE_EVERY))
    fixed = SpecPolicy(k_max=4, rules=HEAD, adaptive=False)
    assert all(fixed.admits_draft(request(), batch=1) for _ in range(HEAD_PROBE_EVERY))
    seq = sequence()
    seq.request.spec_k = 3
    assert head.choose_k(seq, batch=1) == 3
    seq.draft_on = False
    assert head.choose_k(seq, batch=1) == 0


def test_no_probe_with_the_head_where_even_a_good_head_would_not_speculate():
    """At 32 streams of the q4-like costs no k pays even at acceptance
    PROBE_ACCEPTANCE: a probe there would measure nothing that could change
    the choice, so no new sequence keeps a head that does not pay; joining
    one stream, one in HEAD_PROBE_EVERY does."""
    head = seasoned(q4_like_policy(HEAD), accepted=0, proposed=1, times=40)
    assert _best_k(PROBE_ACCEPTANCE, head._step_seconds(32, 0)) == 0
    assert _best_k(PROBE_ACCEPTANCE, head._step_seconds(1, 0)) > 0
    crowded = [head.admits_draft(request(), batch=32) for _ in range(2 * HEAD_PROBE_EVERY)]
    assert not any(crowded)
    assert head.num_without_draft == 2 * HEAD_PROBE_EVERY
    alone = [head.admits_draft(request(), batch=1) for _ in range(HEAD_PROBE_EVERY)]
    assert alone.count(True) == 1


def test_one_poor_request_does_not_take_the_head_off_the_next():
    """Whether a new sequence keeps the head is judged on acceptance over a
    long history: after many requests that accept well, one that accepts
    nothing (a stream's last request says little of its next) turns the
    running estimate down, not the new sequence's head."""
    policy = seasoned(q4_like_policy(HEAD), accepted=3, proposed=4, times=400)
    assert policy.admits_draft(request(), batch=1)
    seasoned(policy, accepted=0, proposed=1, times=100)
    assert policy.acceptance < 0.2 < 0.6 < policy.expected_acceptance
    assert policy.choose_k(lagging(37, lag=0), batch=1) == 0  # the running sequence stops
    assert all(policy.admits_draft(request(), batch=1) for _ in range(2 * HEAD_PROBE_EVERY))
    # a workload that stays poor does take it off, in time
    seasoned(policy, accepted=0, proposed=1, times=2000)
    assert policy.expected_acceptance < 0.2
    assert not all(policy.admits_draft(request(), batch=1) for _ in range(2 * HEAD_PROBE_EVERY))


def test_a_head_that_pays_keeps_every_new_sequence():
    policy = seasoned(cheap_draft_policy(), accepted=3, proposed=4, times=40)
    policy.rules = HEAD
    assert all(policy.admits_draft(request(), batch=1) for _ in range(2 * HEAD_PROBE_EVERY))
    assert policy.num_without_draft == 0


def recomputed(curve: CostCurve) -> list[float]:
    """curve's corrected points as its docstring defines them, from its
    windows and the forwards that last ran each point, computed whole."""
    now = curve.observations
    least = [min(r) if r else None for r in curve._ratios]
    recent = [(log, low) for log, low, last in zip(curve._logs, least, curve._last_run, strict=True)
              if low is not None and last > now - STALE]
    points, floor = [], 0.0
    for log, measured, low, last in zip(curve._logs, curve._ys, least, curve._last_run,
                                        strict=True):
        if low is not None and last > now - STALE:
            scale = low
        elif recent:
            near = min(recent, key=lambda point: abs(point[0] - log))[1]
            scale = min(1.0 if low is None else low, near)
        else:
            scale = 1.0
        floor = max(floor, measured * scale)
        points.append(floor)
    return points


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 5, 8, 12, 30, 64]),
                          st.sampled_from([0.5, 0.8, 0.9, 1.0, 1.1, 1.5, 2.0])),
                min_size=1, max_size=3 * STALE))
def test_a_cost_curve_recomputes_only_what_a_forward_can_change(forwards):
    curve = CostCurve([(1, 0.010), (2, 0.011), (4, 0.013), (8, 0.018), (16, 0.030),
                       (64, 0.100)])
    for items, ratio in forwards:
        before = [curve(n) for n in (1, 2, 4, 8, 16, 64)]
        changed = curve.observe(items, ratio * curve.base(items))
        assert curve._corrected == pytest.approx(recomputed(curve), rel=1e-12)
        assert changed == ([curve(n) for n in (1, 2, 4, 8, 16, 64)] != before)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("costs"), st.sampled_from([1, 2, 4, 9, 33]),
              st.sampled_from([0.7, 1.0, 1.3])),
    st.tuples(st.just("step"), st.lists(st.integers(0, 4), min_size=1, max_size=4),
              st.integers(0, 4)),
    st.tuples(st.just("seconds"), st.booleans(), st.sampled_from([0.0, 0.002, 0.004]))),
    min_size=1, max_size=40))
def test_cached_step_prices_are_those_priced_afresh(events):
    """However forwards, batches and whole steps come, what the policy
    keeps priced is what it would price from nothing."""
    policy = SpecPolicy(k_max=4, rules=DRAFT_MODEL, model_free_k=6)
    policy.calibrate([(1, 0.010), (2, 0.0105), (4, 0.012), (16, 0.030), (64, 0.100)],
                     [(1, 0.001), (4, 0.0012), (64, 0.004)])
    keys = [(batch, lag) for batch in (1, 3) for lag in (0, 1, 5, 40, -1, -2, -3)]
    for kind, a, b in events:
        if kind == "costs":
            policy.observe_costs((a, b * policy.target_cost.base(a)),
                                 [(a, b * policy.draft_cost.base(a))])
        elif kind == "step":
            policy.observe_step(a, min(b, len(a)))
        else:
            target = (2, policy.target_cost(2))
            policy.observe_step_seconds(a, target, [], target[1] + b)
        kept = {key: policy._cached_seconds(*key) for key in keys}
        policy._seconds.clear()
        policy._bases.clear()
        assert kept == {key: policy._cached_seconds(*key) for key in keys}
        for batch, lag in keys:
            if lag >= 0:  # from the bases, the sums step_seconds makes whole
                others = batch - 1
                draft = policy.draft_cost
                if not (policy.calibrated or draft.observations):
                    step = policy.target_cost(1) / sum(PRIOR_TARGET)
                    draft = CostCurve.line(*(step * part for part in PRIOR_DRAFT))
                assert kept[batch, lag] == step_seconds(
                    4, batch, policy.target_cost, draft, batch + others * policy.last_k,
                    others * policy.last_drafting, lag, policy.unpriced)
