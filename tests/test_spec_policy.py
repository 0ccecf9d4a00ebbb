"""The speculation policy alone (pure Python): acceptance bookkeeping, cost
fits and the choice of k."""

import pytest

from specpage.request import Request, SamplingParams, Sequence
from specpage.spec.policy import (
    PROBE_EVERY,
    PROBE_IDLE,
    LinearCost,
    SpecPolicy,
    expected_tokens,
)


def sequence(num_tokens: int = 5, **params) -> Sequence:
    request = Request("r", (1, 2, 3), SamplingParams(max_tokens=64, **params))
    seq = Sequence(0, request, 0, [1, 2, 3] + [9] * (num_tokens - 3))
    request.sequences.append(seq)
    return seq


def cheap_draft_policy() -> SpecPolicy:
    policy = SpecPolicy(k_max=6)
    for _ in range(50):  # a bandwidth-bound target, a draft a tenth of its cost
        policy.observe_costs((1, 0.050), [(1, 0.005)])
        policy.observe_costs((5, 0.055), [])
    return policy


def test_per_token_acceptance_counts_only_tested_proposals():
    policy = SpecPolicy(k_max=4)
    seq = sequence()
    policy.observe_acceptance(seq, proposed=4, accepted=2)  # 3 tested: 2 kept, 1 rejected
    policy.observe_acceptance(seq, proposed=4, accepted=4)  # all 4 tested and kept
    policy.observe_acceptance(seq, proposed=0, accepted=0)  # no speculation: ignored
    assert (policy.num_drafted, policy.num_accepted, policy.num_tested) == (8, 6, 7)
    assert policy.accepted_by_position == [2, 2, 1, 1]


def test_linear_cost_recovers_a_line_from_two_batch_sizes():
    cost = LinearCost(fixed=1.0, per_item=0.0)
    for _ in range(20):
        cost.observe(1, 0.050)
        cost.observe(9, 0.090)
    assert cost.fixed == pytest.approx(0.045, rel=1e-6)
    assert cost.per_item == pytest.approx(0.005, rel=1e-6)


def test_expected_tokens_matches_the_geometric_sum():
    assert expected_tokens(0.5, 4) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    assert expected_tokens(0.0, 4) == 1.0


def test_fixed_k_and_a_request_cap():
    assert SpecPolicy(k_max=4, adaptive=False).choose_k(sequence(), batch=1) == 4
    capped = sequence()
    capped.request.spec_k = 2
    assert SpecPolicy(k_max=4).choose_k(capped, batch=1) == 2


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
    policy = SpecPolicy(k_max=6)
    for _ in range(50):  # a draft a quarter of the target's cost
        policy.observe_costs((1, 0.050), [(1, 0.012)])
        policy.observe_costs((5, 0.055), [])
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
    policy = SpecPolicy(k_max=4)
    for _ in range(50):  # compute-bound: each extra target position costs a lot
        policy.observe_costs((32, 0.150), [(32, 0.008)])
        policy.observe_costs((64, 0.270), [(2, 0.004)])
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
    alone = SpecPolicy(k_max=6).choose_k(sequence(seed=5, temperature=0.8), batch=1)
    assert policy.choose_k(seeded, batch=32) == alone > 0


def test_before_the_draft_has_run_its_cost_is_a_fraction_of_the_measured_target_step():
    """Priors are in units of a target step: a 40 ms target does not make a
    draft that has not run yet look like 0.1 s."""
    policy = SpecPolicy(k_max=4)
    for _ in range(10):
        policy.observe_costs((1, 0.040), [])
        policy.observe_costs((3, 0.042), [])
    seq = sequence()
    for _ in range(5):
        policy.observe_acceptance(seq, proposed=4, accepted=2)
    assert policy.draft_cost.observations == 0
    assert policy.choose_k(seq, batch=1) >= 2


def test_a_slow_catch_up_forward_does_not_price_every_proposal():
    """Draft costs are fitted per forward against its positions: one long
    catch-up forward (16 positions) among one-position proposal forwards
    leaves the per-proposal cost near the latter."""
    policy = SpecPolicy(k_max=4)
    for _ in range(20):
        policy.observe_costs((1, 0.040), [(16, 0.008), (1, 0.003), (1, 0.003)])
    assert policy.draft_cost(1) == pytest.approx(0.003, rel=0.2)
