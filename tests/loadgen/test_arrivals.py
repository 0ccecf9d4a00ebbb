"""Arrival processes, length distributions and workloads: rates, dispersion, determinism."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from loadgen.arrivals import arrival_offsets
from loadgen.errors import UsageError
from loadgen.lengths import parse_lengths
from loadgen.prompts import SharedPrefixes, TextPrompts, TokenPrompts
from loadgen.schedule import Bounds, closed_loop_specs, plan_open_loop, plan_trace
from loadgen.trace import TraceEntry
from loadgen.workload import CancelPolicy, Workload

N = 20_000


def gaps(kind: str, rate: float, seed: int = 0, burstiness: float = 1.0) -> np.ndarray:
    offsets = list(itertools.islice(arrival_offsets(kind, rate, seed, burstiness), N + 1))
    return np.diff(offsets)


def standard_errors(cv: float, kurtosis: float) -> tuple[float, float]:
    """Standard errors of the sample mean (relative) and of the sample CV, for N gaps.

    se(mean)/mean = cv / sqrt(N); se(CV) ~= cv * sqrt((kurtosis - 1) / (4N)) (delta
    method on the sample standard deviation; kurtosis is the plain fourth moment ratio).
    """
    return cv / math.sqrt(N), cv * math.sqrt((kurtosis - 1) / (4 * N))


@pytest.mark.parametrize(
    ("kind", "burstiness", "cv", "kurtosis"),
    [
        ("poisson", 1.0, 1.0, 9.0),  # exponential: kurtosis 9
        ("gamma", 1.0, 1.0, 9.0),  # shape 1 is the exponential
        ("gamma", 0.25, 2.0, 3 + 6 / 0.25),  # gamma(k): CV 1/sqrt(k), kurtosis 3 + 6/k
        ("gamma", 4.0, 0.5, 3 + 6 / 4.0),
    ],
)
def test_rate_and_dispersion_within_four_standard_errors(kind, burstiness, cv, kurtosis):
    rate = 20.0
    sample = gaps(kind, rate, seed=7, burstiness=burstiness)
    se_mean, se_cv = standard_errors(cv, kurtosis)
    assert abs(sample.mean() * rate - 1) < 4 * se_mean
    assert abs(sample.std() / sample.mean() - cv) < 4 * se_cv


@pytest.mark.parametrize(("kind", "burstiness"), [("poisson", 1.0), ("gamma", 0.5), ("gamma", 3)])
def test_gaps_follow_the_requested_distribution(kind, burstiness):
    rate = 5.0
    sample = gaps(kind, rate, seed=3, burstiness=burstiness)
    reference = stats.gamma(burstiness, scale=1 / (rate * burstiness))
    assert stats.kstest(sample, reference.cdf).pvalue > 0.01  # fixed seed: not flaky


def test_constant_rate_is_exact_and_starts_at_zero():
    offsets = list(itertools.islice(arrival_offsets("constant", 4.0, 0), 9))
    assert offsets == pytest.approx([i / 4.0 for i in range(9)])


def test_schedules_are_deterministic_and_scale_with_rate():
    first = list(itertools.islice(arrival_offsets("gamma", 10.0, 42, 0.5), 3000))
    again = list(itertools.islice(arrival_offsets("gamma", 10.0, 42, 0.5), 3000))
    other = list(itertools.islice(arrival_offsets("gamma", 10.0, 43, 0.5), 3000))
    double = list(itertools.islice(arrival_offsets("gamma", 20.0, 42, 0.5), 3000))
    assert first == again
    assert first != other
    # Same seed, twice the rate: the same shape at half the offsets (common random numbers).
    assert np.allclose(np.array(first) / 2, double)


@pytest.mark.parametrize(
    ("text", "mean", "std"),
    [("32", 32, 0), ("fixed:7", 7, 0), ("uniform:10,20", 15, math.sqrt((11**2 - 1) / 12)),
     ("normal:100,10", 100, 10), ("lognormal:50,0.5", 50, 50 * math.sqrt(math.exp(0.25) - 1))],
)
def test_length_distributions(text, mean, std):
    dist = parse_lengths(text, "--prompt-len")
    rng = np.random.default_rng(0)
    sample = np.array([dist.sample(rng) for _ in range(N)])
    assert sample.min() >= 1
    assert abs(sample.mean() - mean) < 4 * std / math.sqrt(N) + 0.5  # + rounding
    assert abs(sample.std() - std) < 0.05 * std + 0.5


def test_lengths_are_clipped_to_one():
    dist = parse_lengths("normal:1,20", "--output-len")
    rng = np.random.default_rng(1)
    assert min(dist.sample(rng) for _ in range(2000)) == 1


@pytest.mark.parametrize("text", ["zipf:3", "uniform:9,3", "normal:1", "fixed:0", "normal:5,x",
                                  "lognormal:10,-1", "fixed:nan"])
def test_bad_length_strings(text):
    with pytest.raises(UsageError, match="--prompt-len"):
        parse_lengths(text, "--prompt-len")


def workload(**extra) -> Workload:
    options = dict(source=TokenPrompts(211), prompt_len=parse_lengths("uniform:4,12", "p"),
                   output_len=parse_lengths("uniform:2,9", "o"), seed=5)
    options.update(extra)
    return Workload(**options)


def test_request_content_depends_on_seed_and_index_only():
    work = workload()
    slow = plan_open_loop(work, arrival_offsets("poisson", 1.0, 5), Bounds(50, None, warmup=2))
    fast = plan_open_loop(work, arrival_offsets("constant", 90.0, 5), Bounds(20, None))
    assert [s.prompt for s in slow[:20]] == [s.prompt for s in fast]
    assert [s.max_tokens for s in slow[:20]] == [s.max_tokens for s in fast]
    assert [s.warmup for s in slow[:3]] == [True, True, False]
    assert len(slow) == 52
    assert all(0 <= t < 211 for s in slow for t in s.prompt)
    assert plan_open_loop(workload(seed=6), arrival_offsets("poisson", 1.0, 6), Bounds(5, None)) \
        != plan_open_loop(work, arrival_offsets("poisson", 1.0, 6), Bounds(5, None))


def test_duration_bounds_the_measured_schedule():
    specs = plan_open_loop(workload(), arrival_offsets("constant", 10.0, 0), Bounds(None, 2.0, 3))
    measured = [s for s in specs if not s.warmup]
    assert len(measured) == 20  # offsets 0.3 .. 2.2, all < 0.3 + 2.0
    assert measured[0].offset_s == pytest.approx(0.3)


def test_shared_prefixes_and_cancellations_follow_their_fractions():
    source = TokenPrompts(211)
    prefixes = SharedPrefixes.build(source, 5, (0.4, 3, 16))
    work = workload(prefixes=prefixes, cancel=CancelPolicy(0.25, 0.5))
    specs = list(closed_loop_specs(work, Bounds(4000, None)))
    with_prefix = [s for s in specs if s.prefix_id is not None]
    assert abs(len(with_prefix) / len(specs) - 0.4) < 4 * math.sqrt(0.24 / len(specs))
    assert {s.prefix_id for s in with_prefix} == {0, 1, 2}
    assert all(s.prompt[:16] == prefixes.prefixes[s.prefix_id] for s in with_prefix)
    cancelled = [s.cancel_after_s for s in specs if s.cancel_after_s is not None]
    assert abs(len(cancelled) / len(specs) - 0.25) < 4 * math.sqrt(0.1875 / len(specs))
    assert min(cancelled) >= 0 and max(cancelled) <= 0.5


def test_text_prompts_take_word_windows():
    source = TextPrompts(tuple(["the", "quick", "brown", "fox", "jumps"]))
    rng = np.random.default_rng(0)
    prompt = source.make(rng, 7)
    assert len(prompt.split()) == 7 and set(prompt.split()) <= set(source.words)


def test_trace_replay_keeps_offsets_prompts_and_sampling():
    entries = [
        TraceEntry(0.0, 3, prompt_text="hello there"),
        TraceEntry(0.5, 4, prompt_token_ids=(1, 2, 3), sampling={"temperature": 0.5}),
        TraceEntry(0.7, 5, prompt_len=6),
        TraceEntry(2.0, 6, prompt_len=2),
    ]
    specs = plan_trace(workload(), entries, Bounds(None, 1.0))
    assert [s.offset_s for s in specs] == [0.0, 0.5, 0.7]
    assert specs[0].prompt == "hello there" and specs[1].prompt == (1, 2, 3)
    assert len(specs[2].prompt) == 6 and [s.max_tokens for s in specs] == [3, 4, 5]
    assert specs[1].sampling == {"temperature": 0.5}
