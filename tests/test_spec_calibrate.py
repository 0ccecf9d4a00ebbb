"""Start-up measurement of forward costs: sizes, the fitted curve, and an
engine that measures before it serves (and serves exactly afterwards)."""

import pytest

from specpage.engine import Engine, EngineConfig
from specpage.models.loader import load_model
from specpage.request import SamplingParams
from specpage.spec.calibrate import MAX_POSITIONS, calibration_sizes, fit_segments
from specpage.spec.policy import CostCurve
from tests.models_util import tiny_checkpoint


def test_sizes_run_from_one_position_to_the_most_a_step_verifies():
    assert calibration_sizes(1) == [1]
    assert calibration_sizes(5) == [1, 2, 3, 4, 5]
    assert calibration_sizes(40) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40]
    assert calibration_sizes(10_000)[-1] == MAX_POSITIONS


def cpu_curve(n: int) -> float:
    """Steps while rows are padded (1 -> 2, 3 -> 4), then 5 ms a position."""
    return {1: 0.050, 2: 0.050, 3: 0.058, 4: 0.058}.get(n, 0.058 + 0.005 * (n - 4))


def test_the_fit_keeps_the_small_steps_and_smooths_a_noisy_point():
    sizes = calibration_sizes(64)
    points = [(n, cpu_curve(n) * (1.3 if n == 24 else 1.0)) for n in sizes]
    fitted = dict(fit_segments(points))
    assert sorted(fitted) == [1, 2, 3, 4, 6, 8, 16, 32, 64]
    for n in (1, 2, 3, 4):
        assert fitted[n] == pytest.approx(cpu_curve(n), rel=0.02)
    # A point timed 30% slow shifts the segments near it a little; none goes
    # flat after it (which would make those positions look free).
    curve = CostCurve(list(fitted.items()))
    slopes = [(curve(n + 8) - curve(n)) / 8 for n in (8, 16, 24, 32, 48)]
    assert all(0.6 * 0.005 < s < 1.6 * 0.005 for s in slopes), slopes
    assert curve(64) == pytest.approx(cpu_curve(64), rel=0.1)


def test_a_curve_from_exact_points_is_the_points():
    points = [(n, cpu_curve(n)) for n in calibration_sizes(64)]
    curve = CostCurve(fit_segments(points))
    assert [curve(n) for n, _ in points] == pytest.approx([s for _, s in points], rel=1e-6)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tiny_checkpoint(root / "target")
    tiny_checkpoint(root / "draft", seed=1, num_hidden_layers=1)
    return load_model(root / "target"), load_model(root / "draft")


def engine(models, draft: bool, **config) -> Engine:
    target, other = models
    options = dict(block_size=4, num_blocks=64, max_num_seqs=8, spec_k=3) | config
    return Engine(target, other if draft else None, None, EngineConfig(**options))


def test_an_adaptive_engine_measures_both_models_and_then_serves_exactly(models):
    eng = engine(models, draft=True)
    policy = eng.policy
    assert policy.calibrated
    # up to 8 sequences x (3 + 1) positions
    assert [n for n, _ in policy.target_cost.points] == [1, 2, 3, 4, 6, 8, 16, 32]
    for curve in (policy.target_cost, policy.draft_cost):
        seconds = [s for _, s in curve.points]
        assert seconds == sorted(seconds) and seconds[0] > 0
    # The timed forwards wrote into free blocks only; nothing is held, and
    # outputs are those of the target alone.
    assert eng.pool.stats().free == 64
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for name, eng_ in (("pair", eng), ("alone", engine(models, draft=False))):
        eng_.add_request("r", [3, 1, 4, 1, 5, 9, 2, 6], params)
        tokens = []
        while eng_.has_unfinished():
            tokens += [t for out in eng_.step() for t in out.token_ids]
        outputs[name] = tokens
    assert outputs["pair"] == outputs["alone"] and len(outputs["alone"]) == 12


def test_fixed_k_or_no_draft_measures_nothing(models):
    assert not engine(models, draft=True, adaptive_k=False).policy.calibrated
    assert not engine(models, draft=False).policy.calibrated
    assert not engine(models, draft=True, spec_k=0).policy.calibrated
