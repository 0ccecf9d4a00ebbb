"""Start-up measurement of forward costs: sizes, the fitted curve, and an
engine that measures before it serves (and serves exactly afterwards)."""

import math
from types import SimpleNamespace

import pytest
import torch

from specpage.core.policy import CostCurve
from specpage.core.request import SamplingParams
from specpage.engine import Engine, EngineConfig
from specpage.models.loader import load_model
from specpage.speculation import calibrate, cost_cache
from specpage.speculation.calibrate import (
    MAX_POSITIONS,
    Plan,
    calibration_sizes,
    fit_segments,
    measure,
)
from tests.support.checkpoints import tiny_checkpoint


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path):
    """Each test measures, or reads only what it wrote itself."""
    monkeypatch.setenv("SPECPAGE_CACHE_DIR", str(tmp_path / "cache"))


def unbounded(monkeypatch) -> None:
    """Engines measure every size, however long the machine takes: what the
    start-up budget leaves out on a slow machine is tested on a fake clock."""
    monkeypatch.setattr("specpage.executor.executor.measure",
                        lambda runners, plan: measure(runners, plan, math.inf))


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
    # the draft's calibration; the target's alone for model-free proposals below
    options = dict(block_size=4, num_blocks=64, max_num_seqs=8, spec_k=3,
                   spec_methods="") | config
    return Engine(target, other if draft else None, None, EngineConfig(**options))


def test_an_adaptive_engine_measures_both_models_and_then_serves_exactly(models, monkeypatch):
    unbounded(monkeypatch)
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
    assert not engine(models, draft=False, spec_k=0, spec_methods="ngram").policy.calibrated


def test_model_free_proposals_without_a_draft_measure_the_target_alone(models):
    policy = engine(models, draft=False, spec_methods="ngram", spec_model_free_k=3).policy
    assert policy.calibrated and policy.k_max == 0 and policy.model_free_k == 3
    # up to 8 sequences x (3 + 1) positions, as for a draft's k = 3
    assert [n for n, _ in policy.target_cost.points] == [1, 2, 3, 4, 6, 8, 16, 32]
    assert policy.draft_cost.observations == 0


class Clock:
    """time.perf_counter for calibrate, moved on only by FakeRunner forwards."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class FakeRunner:
    """A forward costs `fixed` seconds plus `per_position` per position."""

    block_size = 4
    device = torch.device("cpu")
    group_count = 1

    def __init__(self, clock: Clock, fixed: float, per_position: float) -> None:
        self.clock, self.fixed, self.per_position = clock, fixed, per_position
        self.forwards: list[int] = []  # positions of each forward, in order

    def forward(self, spans) -> None:
        positions = sum(len(s.token_ids) for s in spans)
        self.forwards.append(positions)
        self.clock.now += self.fixed + self.per_position * positions


def timed(budget: float) -> tuple[FakeRunner, FakeRunner, list]:
    clock = Clock()
    target, draft = FakeRunner(clock, 0.1, 0.01), FakeRunner(clock, 0.01, 0.001)
    plan = Plan.make(calibration_sizes(16), max_rows=4, num_blocks=64, max_context=512)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate, "time", SimpleNamespace(perf_counter=clock.perf_counter))
        results = measure([(target, True), (draft, False)], plan, budget)
    return target, draft, results


def test_the_measurement_times_one_then_two_then_the_largest_both_models_at_each_size():
    target, draft, (t, d) = timed(budget=100.0)
    first = [1, 1, 2, 16, 3, 4, 6, 8, 12]  # a warm-up forward, then every size
    repeats = [1, 2, 3, 4, 6, 8] * 2  # sizes up to SMALL, twice more
    assert target.forwards == draft.forwards == first + repeats
    assert t.points() == [(n, pytest.approx(0.1 + 0.01 * n)) for n in calibration_sizes(16)]
    assert d.points() == [(n, pytest.approx(0.01 + 0.001 * n)) for n in calibration_sizes(16)]


def test_a_short_budget_leaves_out_repeats_then_sizes_and_starts_no_forward_past_it():
    target, draft, (t, d) = timed(budget=0.6)
    # Both warm-ups and both models at 1 and 2 take 0.374 s. A target forward
    # of 16 is predicted at 8 x its 0.12 s at 2 and left out; of 3, at 0.18 s,
    # it fits (0.543 s with the draft's); of 4, at 0.173 s, not. The draft's
    # forwards are a tenth of that: it is timed up to 8 (0.591 s) but not
    # repeated.
    assert target.forwards == [1, 1, 2, 3]
    assert draft.forwards == [1, 1, 2, 16, 3, 4, 6, 8]
    assert sorted(t) == [1, 2, 3] and sorted(d) == [1, 2, 3, 4, 6, 8, 16]
    assert target.clock.now == pytest.approx(0.591)


def test_a_second_engine_reads_the_costs_the_first_one_measured(models, monkeypatch):
    unbounded(monkeypatch)  # a measurement the budget cut short would not be cached
    first = engine(models, draft=True)
    files = list((cost_cache.cache_dir() / "costs").glob("*.json"))
    assert len(files) == 1

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured despite the cache")

    monkeypatch.setattr("specpage.executor.executor.measure", no_measuring)
    second = engine(models, draft=True)
    assert second.policy.calibrated
    assert second.policy.target_cost.points == first.policy.target_cost.points
    assert second.policy.draft_cost.points == first.policy.draft_cost.points
    # another plan (more rows) or other models measure again
    with pytest.raises(AssertionError, match="despite the cache"):
        engine(models, draft=True, max_num_seqs=4)


def test_the_cache_key_names_both_models_the_machine_the_code_and_graphs(monkeypatch):
    plan = Plan.make([1, 2, 4], 4, 64, 512)
    path = cost_cache.cache_path((b"target", b"draft"), plan, torch.float32, 16)
    assert path.parent == cost_cache.cache_dir() / "costs"
    others = [
        cost_cache.cache_path((b"target", b"other draft"), plan, torch.float32, 16),
        cost_cache.cache_path((b"other target", b"draft"), plan, torch.float32, 16),
        cost_cache.cache_path((b"target", b"draft"), plan, torch.bfloat16, 16),
        cost_cache.cache_path((b"target", b"draft"), plan, torch.float32, 32),
        cost_cache.cache_path((b"target", b"draft"), Plan.make([1, 2, 8], 4, 64, 512),
                              torch.float32, 16),
        cost_cache.cache_path((b"target", b"draft"), plan, torch.float32, 16, graphs=True),
    ]
    monkeypatch.setattr(cost_cache, "code_digest", lambda: "another version of the code")
    others.append(cost_cache.cache_path((b"target", b"draft"), plan, torch.float32, 16))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    others.append(cost_cache.cache_path((b"target", b"draft"), plan, torch.float32, 16))
    assert len({path, *others}) == 1 + len(others)


def test_an_incomplete_measurement_is_not_cached_and_two_sizes_are_needed(models, monkeypatch):
    def one_size(runners, plan, budget=calibrate.BUDGET):
        return [calibrate.Measured({1: 0.01}) for _ in runners]

    monkeypatch.setattr("specpage.executor.executor.measure", one_size)
    eng = engine(models, draft=True)
    assert not eng.policy.calibrated  # no slope measured: the priors, corrected online
    assert not (cost_cache.cache_dir() / "costs").exists()


def test_a_draft_left_unmeasured_keeps_the_priors(models, monkeypatch, tmp_path):
    """A busy machine may spend the budget before the draft's first size:
    calibrating the target alone would price the draft at its prior in
    absolute seconds, a tenth of a second a forward, and it would never run."""
    monkeypatch.setenv("SPECPAGE_CACHE_DIR", str(tmp_path))
    measure = calibrate.measure

    def target_only(*args, **kwargs):
        results = measure(*args, **kwargs)
        results[-1].clear()
        return results

    monkeypatch.setattr("specpage.executor.executor.measure", target_only)
    assert not engine(models, draft=True).policy.calibrated
