"""Drive the requests: open loop at scheduled times, or closed loop with N workers.

Open loop: one loop sleeps until each request's scheduled time and starts a task
for it. Nothing the server does (or fails to do) delays the *schedule*; if the
client itself falls behind, requests go out late, but the record keeps their
scheduled time, latencies count from it, and the send lag is reported. A cap on
requests in flight (--max-inflight) protects the client; waiting for it is
client-side queueing and counts as latency too, unlike a semaphore wrapped around
the timed section (the mistake `vllm bench serve --max-concurrency` makes).

Closed loop: each worker sends its next request when the previous one ends, so
"scheduled" is that moment. This measures a fixed concurrency, and by
construction hides server stalls (coordinated omission); use it knowingly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

from loadgen.backend import Backend
from loadgen.clock import RunClock
from loadgen.record import RequestRecord
from loadgen.workload import RequestSpec

DRAIN_MARGIN_S = 5.0  # past the request timeout, before stragglers are abandoned


@dataclass
class RunCounters:
    """Live counts for the progress display (the records hold the truth)."""

    planned: int | None
    sent: int = 0
    in_flight: int = 0
    completed: int = 0
    errors: int = 0
    cancelled: int = 0
    tokens: int = 0
    max_send_lag_s: float = 0.0

    def finished(self, record: RequestRecord) -> None:
        self.tokens += record.num_tokens
        if record.outcome == "unsent":
            return
        if record.outcome == "completed":
            self.completed += 1
        elif record.outcome == "cancelled":
            self.cancelled += 1
        else:
            self.errors += 1


async def run_open_loop(
    client: Backend, specs: list[RequestSpec], clock: RunClock, counters: RunCounters,
    max_inflight: int,
) -> list[RequestRecord]:
    """Send each spec at clock time spec.offset_s; returns one record per spec."""
    records = [client.new_record(spec) for spec in specs]
    slots = asyncio.Semaphore(max_inflight)
    tasks: set[asyncio.Task[None]] = set()
    for spec, record in zip(specs, records, strict=True):
        assert spec.offset_s is not None
        record.scheduled_s = spec.offset_s
        delay = spec.offset_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(_issue(client, spec, record, (clock, counters), slots))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await _finish(tasks, client.target.request_timeout_s + DRAIN_MARGIN_S)
    return records


async def run_closed_loop(
    client: Backend, specs: Iterator[RequestSpec], clock: RunClock, counters: RunCounters,
    concurrency: int, duration_s: float | None = None,
) -> list[RequestRecord]:
    """`concurrency` workers, each sending its next request as soon as its last one ends."""
    records: list[RequestRecord] = []
    first_measured: list[float] = []  # set once, by whichever worker gets there first

    async def worker() -> None:
        for spec in specs:  # one shared iterator: each spec goes to exactly one worker
            now = clock()
            if not spec.warmup:
                first_measured[:] = first_measured or [now]
                if duration_s is not None and now - first_measured[0] >= duration_s:
                    return
            record = client.new_record(spec)
            record.scheduled_s = now
            records.append(record)
            await _issue(client, spec, record, (clock, counters), None)

    workers = {asyncio.create_task(worker()) for _ in range(concurrency)}
    limit = (duration_s or 0.0) + client.target.request_timeout_s + DRAIN_MARGIN_S
    await _finish(workers, limit)
    return records


async def _issue(
    client: Backend, spec: RequestSpec, record: RequestRecord,
    run: tuple[RunClock, RunCounters], slots: asyncio.Semaphore | None,
) -> None:
    clock, counters = run
    try:
        if slots is not None:
            await slots.acquire()
        try:
            counters.sent += 1
            counters.in_flight += 1
            await client.generate(spec, record, clock)
        finally:
            counters.in_flight -= 1
            if slots is not None:
                slots.release()
            lag = record.send_lag_s
            counters.max_send_lag_s = max(counters.max_send_lag_s, lag or 0.0)
    except asyncio.CancelledError:
        _abandon(record, clock())
        raise
    finally:
        counters.finished(record)


def _abandon(record: RequestRecord, now: float) -> None:
    if record.sent_s is None:
        record.outcome, record.error = "unsent", "the run ended before it was sent"
    else:
        record.end_s = record.end_s if record.end_s is not None else now
        record.outcome, record.status = "error", "CANCELLED"
        record.error = "still running when the run ended"


async def _finish(tasks: set[asyncio.Task[None]], timeout_s: float) -> None:
    """Wait for every task, bounded; abandon what is still running after timeout_s."""
    if not tasks:
        return
    _, pending = await asyncio.wait(set(tasks), timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
