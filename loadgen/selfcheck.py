"""How fast can this client issue requests? Measured against the in-process null target.

First a burst (every request due at once) estimates the client's throughput;
then constant-rate probes confirm a rate the client keeps on schedule (p90 send
lag <= 5 ms, p90 latency <= 50 ms), stepping down by 30% until one holds. A run
whose offered rate is above half of that figure gets a warning: beyond it, send
lag and client-side delays start to colour the latencies (they still count from
scheduled times, but they are then partly the client's own). The null server
shares this process and its event loop, so the figure is a conservative lower bound.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loadgen.backend import RequestOptions, TargetOptions
from loadgen.client import Client
from loadgen.clock import RunClock
from loadgen.metrics import summarize
from loadgen.null_server import start_null_server
from loadgen.record import RequestRecord
from loadgen.runner import RunCounters, run_open_loop
from loadgen.workload import RequestSpec, Workload

WARN_FRACTION = 0.5
# A client that cannot keep up builds a backlog, and then most requests are late, so
# the p90 sees it; a p99 would also fail on one scheduling hiccup of a busy machine.
LAG_LIMIT_S = 0.005  # p90 send lag that still counts as "on schedule"
E2E_LIMIT_S = 0.050  # p90 latency against a target that answers at once
STEP_DOWN = 0.7
MAX_PROBES = 5
BURST_TOKENS = 4000  # tokens streamed by the burst, whatever the output length
PROBE_MAX_REQUESTS = 2000


@dataclass(frozen=True)
class SelfCheck:
    burst_rate: float  # req/s with everything due at once
    sustained_rate: float | None  # highest constant rate that stayed on schedule
    mean_output_tokens: float  # per request in the probes, one chunk each
    send_lag_p90_s: float | None  # of the last probe

    def warning(self, offered_rate: float | None) -> str | None:
        """A warning when offered_rate comes close to what the client can sustain."""
        limit = self.sustained_rate
        if offered_rate is None or limit is None or offered_rate <= WARN_FRACTION * limit:
            return None
        return (
            f"the offered rate {offered_rate:.3g} req/s is {offered_rate / limit:.0%} of the "
            f"{limit:.3g} req/s this client sustains against a null target (self-check); "
            "client overhead may be part of the measured latencies"
        )


async def run_selfcheck(workload: Workload, probe_s: float = 1.0) -> SelfCheck:
    workload = dataclasses.replace(workload, cancel=None)
    server, address = await start_null_server()
    client = Client(TargetOptions(address, request_timeout_s=10.0), RequestOptions(), "selfcheck")
    try:
        mean_tokens = max(1.0, workload.mean_output_len())
        burst = max(20, min(200, int(BURST_TOKENS / mean_tokens)))
        records = await _probe(client, [_spec(workload, i, 0.0) for i in range(burst)])
        burst_rate = _completed_rate(records)
        rate, lag = burst_rate, None
        for _ in range(MAX_PROBES):
            count = max(20, min(PROBE_MAX_REQUESTS, int(rate * probe_s)))
            specs = [_spec(workload, i, i / rate) for i in range(count)]
            summary = summarize(await _probe(client, specs), None)
            lag_stats, e2e_stats = summary.latency["send_lag_s"], summary.latency["e2e_s"]
            lag = lag_stats.p90 if lag_stats else None
            on_time = lag is not None and lag <= LAG_LIMIT_S
            kept_up = e2e_stats is not None and e2e_stats.p90 <= E2E_LIMIT_S
            if summary.counts.completed == count and on_time and kept_up:
                return SelfCheck(burst_rate, rate, mean_tokens, lag)
            rate *= STEP_DOWN
        return SelfCheck(burst_rate, None, mean_tokens, lag)
    finally:
        await client.close()
        await server.stop(None)


def _spec(workload: Workload, index: int, offset_s: float) -> RequestSpec:
    return workload.request(index, False, offset_s)


async def _probe(client: Client, specs: list[RequestSpec]) -> list[RequestRecord]:
    counters = RunCounters(planned=len(specs))
    return await run_open_loop(client, specs, RunClock(0.02), counters, max_inflight=1024)


def _completed_rate(records: list[RequestRecord]) -> float:
    ends = [r.end_s for r in records if r.outcome == "completed" and r.end_s is not None]
    starts = [r.scheduled_s for r in records if r.scheduled_s is not None]
    if not ends or not starts or max(ends) <= min(starts):
        return 0.0
    return len(ends) / (max(ends) - min(starts))
