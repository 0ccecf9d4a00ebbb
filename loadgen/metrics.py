"""Summary metrics from request records: latency percentiles, throughput, SLO goodput.

Only measured requests count (warm-up ones are left out). Latency distributions
use completed requests; ITL pools one value per token; percentiles are numpy's
linear interpolation. Throughput and goodput divide by the measured window: from
the first measured scheduled arrival to the last measured stream end.
SLO attainment is met / (measured - cancelled): a request this run cancelled on
purpose had no chance to meet anything, while errors and unsent requests fail.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from loadgen.record import RequestRecord
from loadgen.slo import Slo

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Stats:
    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stats | None:
        data = np.array([v for v in values if v is not None], dtype=float)
        if data.size == 0:
            return None
        p50, p90, p95, p99 = (float(v) for v in np.percentile(data, PERCENTILES))
        return cls(int(data.size), float(data.mean()), p50, p90, p95, p99, float(data.max()))


@dataclass(frozen=True)
class Counts:
    planned: int
    warmup: int
    measured: int
    sent: int  # measured requests that went out; each ends completed, error or cancelled
    completed: int
    errors: int
    cancelled: int
    unsent: int
    errors_by_status: dict[str, int]


@dataclass(frozen=True)
class Summary:
    counts: Counts
    window_s: float
    offered_rate: float | None  # realised by the measured schedule, req/s
    request_throughput: float  # completed req/s
    output_token_throughput: float  # tokens streamed (server num_tokens) per second
    output_tokens: int
    prompt_tokens: int  # server usage, completed requests
    cached_tokens: int  # of those, served from the server's prefix cache
    latency: dict[str, Stats | None]  # ttft_s, tpot_s, itl_s, e2e_s, queue_s, send_lag_s
    slo: Slo | None
    slo_met: int | None
    slo_attainment: float | None  # fraction in [0, 1]
    goodput: float | None  # req/s that met every SLO

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], slo: Slo | None) -> Summary:
    measured = [r for r in records if not r.warmup]
    completed = [r for r in measured if r.outcome == "completed"]
    window = _window(measured)
    output_tokens = sum(r.num_tokens for r in measured)
    met = None if slo is None else sum(slo.met(r.ttft_s, r.tpot_s, r.e2e_s) for r in completed)
    eligible = sum(r.outcome != "cancelled" for r in measured)
    return Summary(
        counts=_counts(records, measured),
        window_s=window,
        offered_rate=_offered_rate(measured),
        request_throughput=_rate(len(completed), window),
        output_token_throughput=_rate(output_tokens, window),
        output_tokens=output_tokens,
        prompt_tokens=sum(r.prompt_tokens or 0 for r in completed),
        cached_tokens=sum(r.cached_tokens or 0 for r in completed),
        latency=latency_stats(completed, measured),
        slo=slo,
        slo_met=met,
        slo_attainment=None if met is None else (met / eligible if eligible else 0.0),
        goodput=None if met is None else _rate(met, window),
    )


def latency_stats(
    completed: Sequence[RequestRecord], measured: Sequence[RequestRecord]
) -> dict[str, Stats | None]:
    return {
        "ttft_s": Stats.of(r.ttft_s for r in completed),
        "tpot_s": Stats.of(r.tpot_s for r in completed),
        "itl_s": Stats.of(gap for r in completed for gap in r.itl_s()),
        "e2e_s": Stats.of(r.e2e_s for r in completed),
        "queue_s": Stats.of(r.queue_s for r in completed),
        "send_lag_s": Stats.of(r.send_lag_s for r in measured),
    }


def _counts(records: Sequence[RequestRecord], measured: Sequence[RequestRecord]) -> Counts:
    outcomes = Counter(r.outcome for r in measured)
    by_status = Counter(r.status or "NONE" for r in measured if r.outcome == "error")
    return Counts(
        planned=len(records),
        warmup=len(records) - len(measured),
        measured=len(measured),
        sent=sum(r.sent_s is not None for r in measured),
        completed=outcomes["completed"],
        errors=outcomes["error"],
        cancelled=outcomes["cancelled"],
        unsent=outcomes["unsent"],
        errors_by_status=dict(sorted(by_status.items())),
    )


def _window(measured: Sequence[RequestRecord]) -> float:
    starts = [r.scheduled_s for r in measured if r.scheduled_s is not None]
    ends = [r.end_s for r in measured if r.end_s is not None]
    return max(ends) - min(starts) if starts and ends else 0.0


def _offered_rate(measured: Sequence[RequestRecord]) -> float | None:
    times = sorted(r.scheduled_s for r in measured if r.scheduled_s is not None)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return (len(times) - 1) / span if span > 0 else None


def _rate(count: float, window_s: float) -> float:
    return count / window_s if window_s > 0 else 0.0
