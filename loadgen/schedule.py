"""Turn a workload and an arrival process into the bounded list of requests a run sends.

The first `warmup` arrivals are warm-up requests: sent at the same load as the
rest (so the measured window starts in steady state), never measured. A run ends
after `requests` measured requests or when arrivals pass `duration_s` after the
first measured one, whichever comes first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from loadgen.errors import UsageError
from loadgen.trace import TraceEntry
from loadgen.workload import RequestSpec, Workload

MAX_PLANNED = 1_000_000  # a plan past this is a typo (rate x duration), not a load test


@dataclass(frozen=True)
class Bounds:
    requests: int | None  # measured requests
    duration_s: float | None  # of the measured schedule
    warmup: int = 0

    def __post_init__(self) -> None:
        assert self.requests is not None or self.duration_s is not None, "a run must be bounded"


def plan_open_loop(
    workload: Workload, offsets: Iterable[float], bounds: Bounds
) -> list[RequestSpec]:
    """Requests at the given scheduled offsets, until the bounds are reached."""
    return _plan(workload, ((offset, None) for offset in offsets), bounds)


def plan_trace(workload: Workload, entries: list[TraceEntry], bounds: Bounds) -> list[RequestSpec]:
    """Requests at the trace's own offsets; the trace's end also ends the run."""
    return _plan(workload, ((entry.offset_s, entry) for entry in entries), bounds)


def closed_loop_specs(
    workload: Workload, bounds: Bounds, entries: list[TraceEntry] | None = None
) -> Iterator[RequestSpec]:
    """Requests without scheduled times; the runner stops taking them at duration_s."""
    limit = bounds.warmup + bounds.requests if bounds.requests is not None else MAX_PLANNED
    if entries is not None:
        limit = min(limit, len(entries))
    for index in range(limit):
        entry = entries[index] if entries is not None else None
        yield workload.request(index, index < bounds.warmup, None, entry)


def _plan(
    workload: Workload, arrivals: Iterable[tuple[float, TraceEntry | None]], bounds: Bounds
) -> list[RequestSpec]:
    specs: list[RequestSpec] = []
    first_measured: float | None = None
    for index, (offset, entry) in enumerate(arrivals):
        warmup = index < bounds.warmup
        if not warmup:
            first_measured = offset if first_measured is None else first_measured
            if bounds.requests is not None and index - bounds.warmup >= bounds.requests:
                break
            if bounds.duration_s is not None and offset - first_measured >= bounds.duration_s:
                break
        if index >= MAX_PLANNED:
            raise UsageError(f"the run would send more than {MAX_PLANNED} requests; lower the "
                             "rate, --duration or --requests")
        specs.append(workload.request(index, warmup, offset, entry))
    return specs
