"""Metrics math on synthetic records: per-request latencies, percentiles, goodput, sweeps."""

import asyncio

import numpy as np
import pytest

from loadgen.commands import knee_of
from loadgen.errors import UsageError
from loadgen.metrics import Stats, summarize
from loadgen.record import RequestRecord
from loadgen.slo import Slo, parse_slo
from loadgen.sweep import Knee, SweepPlan, find_knee
from loadgen.units import parse_seconds


def record(index: int, scheduled: float, chunks, end: float | None = None, **extra):
    """A finished record: chunks are (time, cumulative tokens); end defaults to the last chunk."""
    rec = RequestRecord(index=index, warmup=extra.pop("warmup", False), request_id=f"r{index}",
                        prompt_len=4, max_tokens=8)
    rec.scheduled_s = scheduled
    rec.sent_s = extra.pop("sent", scheduled)
    for now, count in chunks:
        rec.add_chunk(now, count)
    rec.end_s = end if end is not None else (chunks[-1][0] if chunks else scheduled)
    rec.outcome = extra.pop("outcome", "completed")
    rec.status = extra.pop("status", "OK" if rec.outcome == "completed" else "INTERNAL")
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_per_request_latencies_use_scheduled_time_and_server_counts():
    # Sent 0.2 s late: every latency still counts from the scheduled 1.0.
    rec = record(0, 1.0, [(1.5, 1), (1.8, 4), (2.0, 5)], end=2.01, sent=1.2)
    assert rec.send_lag_s == pytest.approx(0.2)
    assert rec.ttft_s == pytest.approx(0.5)
    assert rec.e2e_s == pytest.approx(1.01)
    assert rec.num_tokens == 5  # from num_tokens, although only three chunks came
    assert rec.tpot_s == pytest.approx(0.5 / 4)
    assert rec.itl_s() == pytest.approx([0.1, 0.1, 0.1, 0.2])
    assert np.mean(rec.itl_s()) == pytest.approx(rec.tpot_s)


def test_extra_tokens_in_the_first_chunk_have_zero_gaps():
    rec = record(0, 0.0, [(0.3, 3), (0.7, 5)])
    assert rec.itl_s() == pytest.approx([0.0, 0.0, 0.2, 0.2])
    assert rec.tpot_s == pytest.approx(0.4 / 4)


def test_chunks_without_new_tokens_change_nothing():
    rec = record(0, 0.0, [(0.1, 1), (0.2, 1), (0.3, 2), (0.35, 0)])
    assert rec.chunks == [(0.1, 1), (0.3, 2)]
    assert rec.itl_s() == pytest.approx([0.2])


def test_single_token_requests_have_no_tpot():
    rec = record(0, 0.0, [(0.1, 1)])
    assert rec.tpot_s is None and rec.itl_s() == []


def test_stats_match_numpy_percentiles():
    values = list(np.random.default_rng(0).exponential(1.0, 999))
    got = Stats.of(values)
    assert got is not None and got.count == 999
    expected = np.percentile(values, [50, 90, 95, 99])
    assert [got.p50, got.p90, got.p95, got.p99] == pytest.approx(list(expected))
    assert got.mean == pytest.approx(np.mean(values)) and got.max == max(values)
    assert Stats.of([]) is None and Stats.of([None]) is None
    assert Stats.of([2.0]) == Stats(1, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0)


def synthetic_run() -> list[RequestRecord]:
    return [
        record(0, -1.0, [(-0.5, 2)], warmup=True),  # warm-up: never counted
        record(1, 0.0, [(0.1, 1), (0.3, 3)], end=0.3, queue_s=0.01),  # ttft .1 tpot .1
        record(2, 1.0, [(1.5, 1), (1.9, 3)], end=1.9, queue_s=0.03),  # ttft .5 tpot .2
        record(3, 2.0, [(2.2, 1), (2.3, 2), (2.4, 3)], end=4.0),  # ttft .2, e2e 2.0
        record(4, 3.0, [(3.1, 1)], end=3.2, outcome="cancelled", status="CANCELLED"),
        record(5, 3.5, [], end=3.6, outcome="error", status="RESOURCE_EXHAUSTED"),
        record(6, 3.6, [], end=3.7, outcome="error", status="RESOURCE_EXHAUSTED"),
        record(7, 3.7, [], end=3.75, outcome="error", status="INTERNAL"),
    ]


def test_summary_counts_rates_and_latencies():
    summary = summarize(synthetic_run(), None)
    counts = summary.counts
    assert (counts.planned, counts.warmup, counts.measured, counts.sent) == (8, 1, 7, 7)
    assert (counts.completed, counts.errors, counts.cancelled) == (3, 3, 1)
    assert counts.errors_by_status == {"INTERNAL": 1, "RESOURCE_EXHAUSTED": 2}
    assert summary.window_s == pytest.approx(4.0)  # scheduled 0.0 .. last end 4.0
    assert summary.request_throughput == pytest.approx(3 / 4.0)
    assert summary.output_tokens == 3 + 3 + 3 + 1  # the cancelled one streamed one token
    assert summary.output_token_throughput == pytest.approx(10 / 4.0)
    assert summary.offered_rate == pytest.approx(6 / 3.7)
    ttft = summary.latency["ttft_s"]
    assert ttft is not None and ttft.count == 3
    assert ttft.mean == pytest.approx((0.1 + 0.5 + 0.2) / 3)
    assert ttft.p50 == pytest.approx(0.2)
    assert summary.latency["tpot_s"].max == pytest.approx(0.2)
    assert summary.latency["e2e_s"].max == pytest.approx(2.0)
    assert summary.latency["itl_s"].count == 2 + 2 + 2
    assert summary.latency["queue_s"].count == 2
    assert summary.slo is None and summary.goodput is None and summary.slo_attainment is None


def test_goodput_and_attainment():
    slo = parse_slo("ttft=300ms,tpot=150ms,e2e=1s")
    summary = summarize(synthetic_run(), slo)
    # 1 meets all; 2 fails ttft and tpot; 3 fails e2e; errors fail; the cancel is excluded.
    assert summary.slo_met == 1
    assert summary.slo_attainment == pytest.approx(1 / 6)
    assert summary.goodput == pytest.approx(1 / 4.0)
    loose = summarize(synthetic_run(), parse_slo("ttft=1s"))
    assert loose.slo_met == 3 and loose.slo_attainment == pytest.approx(3 / 6)


def test_slo_check_per_request():
    slo = Slo(ttft_s=0.2, tpot_s=0.05)
    assert slo.met(0.2, 0.05, 9.0)
    assert not slo.met(0.21, 0.01, 1.0)
    assert slo.met(0.1, None, 1.0)  # one token: no TPOT to miss
    assert not slo.met(None, None, 1.0)
    assert not Slo(e2e_s=1.0).met(0.1, 0.01, None)


def test_parse_slo_units():
    slo = parse_slo("ttft=2000ms, tpot=200ms,e2e=10s")
    assert (slo.ttft_s, slo.tpot_s, slo.e2e_s) == pytest.approx((2.0, 0.2, 10.0))
    assert parse_slo("TTFT=1.5s").ttft_s == pytest.approx(1.5)
    assert parse_slo("tpot=500us").tpot_s == pytest.approx(5e-4)
    assert slo.describe() == "ttft=2000ms,tpot=200ms,e2e=10000ms"


@pytest.mark.parametrize(
    ("text", "message"),
    [("ttft=2000", "needs a unit"), ("ttft:2s", "KEY=DURATION"), ("latency=1s", "unknown key"),
     ("ttft=1s,ttft=2s", "twice"), ("ttft=0ms", "> 0"), ("ttft=fast", "not a duration"),
     ("", "KEY=DURATION"), ("ttft=2 hours", "needs a unit")],
)
def test_malformed_slo_strings(text, message):
    with pytest.raises(UsageError, match=message):
        parse_slo(text)


def test_parse_seconds():
    assert parse_seconds("30", "--duration") == 30.0
    assert parse_seconds("250ms", "--duration") == pytest.approx(0.25)
    assert parse_seconds("2m", "--duration") == 120.0
    with pytest.raises(UsageError, match="--duration"):
        parse_seconds("-3s", "--duration")


def run_sweep(plan: SweepPlan, capacity: float) -> tuple[Knee, list[float]]:
    tried: list[float] = []

    async def passes(rate: float) -> bool:
        tried.append(rate)
        return rate <= capacity

    return asyncio.run(find_knee(plan, passes)), tried


def test_sweep_doubles_then_bisects():
    knee, tried = run_sweep(SweepPlan(1.0, bisect_steps=3), capacity=37.0)
    assert tried == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36]
    assert knee == Knee(36.0, 40.0)


def test_sweep_halves_when_the_start_fails():
    knee, tried = run_sweep(SweepPlan(100.0, bisect_steps=2), capacity=30.0)
    assert tried == [100, 50, 25, 37.5, 31.25]
    assert knee == Knee(25.0, 31.25)


def test_sweep_bounds_its_steps():
    knee, tried = run_sweep(SweepPlan(1.0, bisect_steps=3, max_steps=3), capacity=1e9)
    assert tried == [1, 2, 4, 8] and knee == Knee(8.0, None)
    knee, tried = run_sweep(SweepPlan(1.0, bisect_steps=3, max_steps=2), capacity=0.1)
    assert tried == [1, 0.5, 0.25] and knee == Knee(None, 0.25)


def test_knee_from_saved_points():
    summary = summarize([], None)
    points = [(rate, rate <= 36, summary, []) for rate in (1, 2, 4, 8, 16, 32, 64, 48, 40, 36)]
    assert knee_of(points) == 36
    assert knee_of([(5.0, False, summary, [])]) is None
