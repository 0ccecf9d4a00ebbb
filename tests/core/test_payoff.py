"""The measured payoff of model-free proposals, per batch class: a class
whose model-free steps make fewer tokens per priced second than its plain
steps goes without them but for probes, and comes back once they pay."""

from specpage.core.payoff import LEAST, PROBE_EVERY, PROBE_RARELY, Payoff


def run(payoff: Payoff, batch: int, steps: int, gain: float) -> list[bool]:
    """Steps at `batch` where a model-free step makes `gain` times a plain
    step's tokens in the same time; what was allowed at each."""
    allowed = []
    for _ in range(steps):
        allows = payoff.allows(batch)
        allowed.append(allows)
        tokens = round(batch * gain) if allows else batch
        payoff.observe(batch, allows, tokens, seconds=0.02, plain_seconds=0.02)
    return allowed


def test_a_class_where_model_free_steps_lose_goes_without_them_but_for_probes():
    payoff = Payoff()
    allowed = run(payoff, 32, 20 * PROBE_EVERY, gain=0.9)
    late = allowed[-4 * PROBE_EVERY :]
    assert late.count(True) == 4  # one probe in PROBE_EVERY steps
    assert payoff.allows(1) and payoff.allows(2)  # other classes are not judged yet


def test_a_class_where_they_pay_keeps_them_and_measures_plain_steps_now_and_then():
    payoff = Payoff()
    allowed = run(payoff, 8, 20 * PROBE_EVERY, gain=1.1)
    assert allowed[-4 * PROBE_EVERY :].count(False) == 4


def test_where_they_clearly_pay_plain_steps_are_measured_rarely():
    payoff = Payoff()
    allowed = run(payoff, 1, 20 * PROBE_RARELY, gain=2.0)
    assert allowed[-4 * PROBE_RARELY :].count(False) == 4


def test_a_class_comes_back_once_model_free_steps_pay_again():
    payoff = Payoff()
    run(payoff, 32, 20 * PROBE_EVERY, gain=0.8)
    assert not payoff.classes[32 .bit_length()].pays
    run(payoff, 32, int(LEAST) * PROBE_EVERY * 4, gain=1.3)
    assert payoff.classes[32 .bit_length()].pays


def test_steps_of_different_batches_in_a_class_compare_by_their_priced_seconds():
    payoff = Payoff()
    for step in range(40):
        batch = 16 + step % 16  # one class
        # plain steps take their price; model-free ones 10% longer for 20% more tokens
        payoff.observe(batch, False, batch, 0.001 * batch, 0.001 * batch)
        payoff.observe(batch, True, round(batch * 1.2), 0.0011 * batch, 0.001 * batch)
    assert payoff.classes[16 .bit_length()].pays
