"""Measurement against a scripted in-process gRPC server: exact latencies, stalls, errors.

The fake server runs on the test's event loop at 127.0.0.1:0 and follows a script
per request (picked by the index at the end of the request id): when the first
chunk comes, how many tokens each later chunk carries, the gap between chunks,
and an optional error. With `serialize`, it serves one request at a time, so a
slow request makes every later one queue: open-loop measurement from scheduled
arrival times must show that queueing; a closed loop hides it.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest

from loadgen import selfcheck
from loadgen.arrivals import arrival_offsets
from loadgen.backend import RequestOptions, TargetOptions
from loadgen.client import Client
from loadgen.clock import RunClock
from loadgen.lengths import parse_lengths
from loadgen.metrics import summarize
from loadgen.prompts import TokenPrompts
from loadgen.record import RequestRecord
from loadgen.runner import RunCounters, run_closed_loop, run_open_loop
from loadgen.schedule import Bounds, closed_loop_specs, plan_open_loop
from loadgen.selfcheck import SelfCheck, run_selfcheck
from loadgen.slo import parse_slo
from loadgen.workload import CancelPolicy, Workload
from specpage.serve.grpc_stubs import generation_pb2 as pb
from specpage.serve.grpc_stubs import generation_pb2_grpc as pb_grpc
from tests.support.loop_watch import LoopWatch

TOLERANCE_S = 0.015  # one event loop serves client and server on a shared 2-core machine
HANG_GUARD_S = 60.0  # a wait for what must happen: a bound on a hang, not on the speed


@pytest.fixture(autouse=True, scope="module")
def no_collection_of_earlier_objects():
    """In the full suite this process holds the models and modules of every
    earlier test; a garbage collection that walks them pauses the event loop
    for tens of milliseconds mid-measurement. A loadgen process holds none of
    that, so the objects present now are left out of collections here."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@dataclass(frozen=True)
class Script:
    first_s: float = 0.05  # request received -> first chunk
    chunks: tuple[int, ...] = (1, 3, 2, 1)  # tokens per chunk
    gap_s: float = 0.02  # between chunks
    error: grpc.StatusCode | None = None  # abort instead of answering


@dataclass
class ScriptedGeneration(pb_grpc.GenerationServicer):
    scripts: dict[int, Script] = field(default_factory=dict)
    default: Script = Script()
    serialize: bool = False
    cancelled: list[int] = field(default_factory=list)
    started: dict[int, float] = field(default_factory=dict)  # perf_counter at service start
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def Generate(self, request, context):  # noqa: N802
        index = int(request.request_id.rsplit("-", 1)[1])
        script = self.scripts.get(index, self.default)
        finished = False
        try:
            if self.serialize:
                async with self.lock:
                    self.started[index] = time.perf_counter()
                    async for event in self._answer(script, context):
                        yield event
            else:
                async for event in self._answer(script, context):
                    yield event
            finished = True
        finally:
            # Cancellation arrives as CancelledError or, at a yield, as GeneratorExit.
            if not finished:
                self.cancelled.append(index)

    async def _answer(self, script: Script, context):
        await asyncio.sleep(script.first_s)
        if script.error is not None:
            context.set_trailing_metadata((("retry-after-ms", "250"),))
            await context.abort(script.error, f"scripted {script.error.name}")
        count = 0
        for position, size in enumerate(script.chunks):
            if position:
                await asyncio.sleep(script.gap_s)
            count += size
            yield pb.GenerateEvent(chunk=pb.Chunk(token_ids=[7] * size, num_tokens=count))
        timings = pb.Timings(queue_s=0.004, prefill_s=script.first_s)
        usage = pb.Usage(prompt_tokens=4, completion_tokens=count)
        yield pb.GenerateEvent(final=pb.Final(usage=usage, timings=timings, finish_reason="length"))


async def start(servicer: ScriptedGeneration, stack: AsyncExitStack) -> Client:
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stack.push_async_callback(server.stop, None)
    client = Client(TargetOptions(f"127.0.0.1:{port}", request_timeout_s=60), RequestOptions(), "t")
    stack.push_async_callback(client.close)
    await client.wait_healthy(HANG_GUARD_S)  # no health service here: this opens the connection
    return client


def workload(cancel: CancelPolicy | None = None) -> Workload:
    fixed = parse_lengths("4", "len")
    return Workload(TokenPrompts(211), fixed, fixed, seed=1, cancel=cancel)


async def open_loop(
    client: Client, rate: float, count: int, clock: RunClock | None = None, **kwargs
) -> list[RequestRecord]:
    offsets = arrival_offsets("constant", rate, 0)
    bounds = Bounds(count, None, warmup=kwargs.pop("warmup", 0))
    specs = plan_open_loop(kwargs.pop("work", workload()), offsets, bounds)
    counters = RunCounters(planned=len(specs))
    return await run_open_loop(client, specs, clock or RunClock(0.02), counters,
                               kwargs.pop("max_inflight", 64))


async def closed_loop(client: Client, count: int) -> list[RequestRecord]:
    specs = closed_loop_specs(workload(), Bounds(count, None))
    return await run_closed_loop(client, specs, RunClock(0.02), RunCounters(None), 1)


def near(value: float | None, expected: float, tolerance: float = TOLERANCE_S) -> bool:
    return value is not None and abs(value - expected) <= tolerance


@pytest.mark.asyncio
async def test_latencies_from_multi_token_chunks():
    async with AsyncExitStack() as stack:
        watch = await stack.enter_async_context(LoopWatch())
        client = await start(ScriptedGeneration(), stack)
        # One warm-up request opens the connection; it is left out below, as in a run.
        records = await open_loop(client, rate=5.0, count=3, warmup=1)
    assert records[0].warmup
    records, late = records[1:], watch.late_s
    for rec in records:
        assert rec.outcome == "completed" and rec.status == "OK"
        assert rec.num_tokens == 7 and len(rec.chunks) == 4  # 1+3+2+1 tokens in four chunks
        assert rec.completion_tokens == 7 and rec.queue_s == pytest.approx(0.004)
        assert near(rec.send_lag_s, 0.0, 0.005 + late)
        assert near(rec.ttft_s, 0.05, TOLERANCE_S + late)
        assert near(rec.e2e_s, 0.05 + 3 * 0.02, 2 * TOLERANCE_S + late)  # four chained sleeps
        assert near(rec.tpot_s, 3 * 0.02 / 6, 0.004 + late / 6)
        # Exactly the definitions, on the recorded times:
        times = [now for now, _ in rec.chunks]
        assert rec.ttft_s == times[0] - rec.scheduled_s
        assert rec.tpot_s == pytest.approx((times[-1] - times[0]) / 6)
        gaps = np.diff(times)
        assert rec.itl_s() == pytest.approx([gaps[0] / 3] * 3 + [gaps[1] / 2] * 2 + [gaps[2]])
        assert all(near(gap, 0.02, 0.008 + late) for gap in gaps)
    # SLOs the scripted timings meet with room to spare, widened by the loop's
    # lateness, which may have added to any of them (as to the bounds above)
    slack_ms = math.ceil(1000 * late)
    summary = summarize(records, parse_slo(
        f"ttft={100 + slack_ms}ms,tpot={50 + slack_ms}ms,e2e={1000 + slack_ms}ms"))
    assert summary.slo_attainment == 1.0 and summary.slo_met == 3
    assert summary.latency["itl_s"].count == 18
    assert summary.latency["itl_s"].mean == pytest.approx(summary.latency["tpot_s"].mean)
    assert summarize(records, parse_slo("tpot=5ms")).slo_attainment == 0.0


SERVICE_S = 0.05 + 5 * 0.01  # first chunk after 50 ms, then five more 10 ms apart
STALL_S = 0.5  # request 2 takes this long to its first token


def stalling_server() -> ScriptedGeneration:
    normal = Script(first_s=0.05, chunks=(1,) * 6, gap_s=0.01)
    stalled = Script(first_s=STALL_S, chunks=(1,) * 6, gap_s=0.01)
    return ScriptedGeneration(scripts={2: stalled}, default=normal, serialize=True)


@pytest.mark.asyncio
async def test_open_loop_exposes_queueing_behind_a_stall():
    servicer = stalling_server()
    async with AsyncExitStack() as stack:
        watch = await stack.enter_async_context(LoopWatch())
        client = await start(servicer, stack)
        # the schedule starts once the server is up: starting it takes a busy
        # machine a few hundred ms, which would count as the first send's lag
        clock = RunClock(0.02)
        records = await open_loop(client, rate=10.0, count=8, clock=clock)
    late = watch.late_s
    # Served one at a time: request i starts at max(its arrival, previous finish).
    finish, model_ttft = 0.0, []
    for i in range(8):
        begin = max(i * 0.1, finish)
        first = STALL_S if i == 2 else 0.05
        model_ttft.append(begin + first - i * 0.1)
        finish = begin + first + 0.05
    assert model_ttft[3:] == pytest.approx([0.5] * 5)  # all queued behind the stall
    for i, (rec, modelled) in enumerate(zip(records, model_ttft, strict=True)):
        assert near(rec.send_lag_s, 0.0, 0.005 + late)  # the client kept the schedule
        # Exactly: the wait for the server's lock plus the scripted first-chunk delay...
        waited = servicer.started[i] - clock.start - rec.scheduled_s
        assert near(rec.ttft_s, waited + (STALL_S if i == 2 else 0.05), TOLERANCE_S + late)
        # ...and never less than the queueing model: a sleep is never shorter than asked.
        # (A busy machine lengthens the service of each request, and so the wait of the
        # next: how much more than the model is what the line above checks, on the
        # server's recorded times.)
        assert rec.ttft_s >= modelled - 0.01
    summary = summarize(records, parse_slo("ttft=200ms"))
    assert summary.latency["ttft_s"].p50 > 0.4
    # From the stall on every request is queued past the SLO, whatever the machine's
    # speed; the two before it met it if the machine did not hold them 150 ms.
    assert [rec.ttft_s <= 0.2 for rec in records[2:]] == [False] * 6
    met_before = sum(rec.ttft_s <= 0.2 for rec in records[:2])
    assert summary.slo_met == met_before
    assert summary.slo_attainment == pytest.approx(met_before / 8)


@pytest.mark.asyncio
async def test_closed_loop_hides_the_same_stall():
    async with AsyncExitStack() as stack:
        watch = await stack.enter_async_context(LoopWatch())
        client = await start(stalling_server(), stack)
        records = await closed_loop(client, 8)
    ttfts, late = [rec.ttft_s for rec in records], watch.late_s
    assert near(ttfts[2], STALL_S, 0.02 + late)
    assert all(near(t, 0.05, TOLERANCE_S + late) for i, t in enumerate(ttfts) if i != 2)
    # An SLO the unstalled requests meet, widened by the loop's lateness (as the bounds
    # above are), short of the stall's first chunk, which comes at 500 ms at the soonest
    slo_ms = min(200 + math.ceil(1000 * late), 450)
    summary = summarize(records, parse_slo(f"ttft={slo_ms}ms"))
    assert summary.latency["ttft_s"].p50 < 0.07 + late
    assert summary.slo_attainment == pytest.approx(7 / 8)  # looks fine, is not


@pytest.mark.asyncio
async def test_client_side_waiting_counts_as_latency():
    # One request in flight at a time, 300 ms each, arrivals every 100 ms: the
    # client queues them. Latency from scheduled time includes that wait.
    slow = Script(first_s=0.25, chunks=(1, 1), gap_s=0.05)
    async with AsyncExitStack() as stack:
        watch = await stack.enter_async_context(LoopWatch())
        client = await start(ScriptedGeneration(default=slow), stack)
        records = await open_loop(client, rate=10.0, count=4, max_inflight=1)
    late = watch.late_s
    assert near(records[0].send_lag_s, 0.0, 0.005 + late)
    for i, rec in enumerate(records):
        if i:  # sent the moment the slot freed, i.e. when the previous request ended
            assert near(rec.sent_s, records[i - 1].end_s, 0.01 + late)
            assert rec.send_lag_s >= i * 0.2 - 0.01  # 300 ms each, arriving every 100 ms
        # The wait is in the latency: TTFT = client-side wait + the server's 250 ms.
        assert rec.ttft_s == pytest.approx(rec.send_lag_s + (rec.first_token_s - rec.sent_s))
        assert near(rec.ttft_s - rec.send_lag_s, 0.25, TOLERANCE_S + late)


@pytest.mark.asyncio
async def test_errors_are_counted_by_status_with_retry_after():
    scripts = {1: Script(first_s=0.01, error=grpc.StatusCode.RESOURCE_EXHAUSTED),
               2: Script(first_s=0.01, error=grpc.StatusCode.INVALID_ARGUMENT)}
    async with AsyncExitStack() as stack:
        client = await start(ScriptedGeneration(scripts=scripts), stack)
        records = await open_loop(client, rate=20.0, count=4)
    assert [r.outcome for r in records] == ["completed", "error", "error", "completed"]
    assert records[1].status == "RESOURCE_EXHAUSTED" and records[1].retry_after_ms == 250
    assert "scripted" in records[2].error
    summary = summarize(records, parse_slo("e2e=60s"))  # met by whatever completes
    assert summary.counts.errors_by_status == {"INVALID_ARGUMENT": 1, "RESOURCE_EXHAUSTED": 1}
    assert summary.slo_attainment == pytest.approx(2 / 4)


@pytest.mark.asyncio
async def test_planned_cancellations_end_the_stream_on_time():
    slow = Script(first_s=0.02, chunks=(1,) * 40, gap_s=0.02)
    servicer = ScriptedGeneration(default=slow)
    async with AsyncExitStack() as stack:
        watch = await stack.enter_async_context(LoopWatch())
        client = await start(servicer, stack)
        records = await open_loop(client, rate=20.0, count=6,
                                  work=workload(CancelPolicy(1.0, 0.3)))
        # A request cancelled well after it started streaming must be seen cancelled by
        # the server (one cancelled at once may never have reached the handler).
        streaming = {r.index for r in records if r.cancel_after_s > 0.05}
        end = time.monotonic() + HANG_GUARD_S  # the server's side of the cancellations
        while not streaming <= set(servicer.cancelled) and time.monotonic() < end:
            await asyncio.sleep(0.01)
    for rec in records:
        assert rec.outcome == "cancelled" and rec.status == "CANCELLED"
        assert near(rec.end_s - rec.sent_s, rec.cancel_after_s, 0.02 + watch.late_s)
        assert rec.num_tokens < 40
    assert len(streaming) >= 3 and streaming <= set(servicer.cancelled)
    summary = summarize(records, parse_slo("ttft=1s"))
    counts = summary.counts
    assert counts.completed + counts.errors + counts.cancelled == counts.sent == 6
    assert summary.slo_attainment == 0.0  # nothing eligible


class ServedClock(RunClock):
    """A run clock that moves only as the scripted server answers: each
    request's first_s is added when its first chunk is sent. A duration bound
    read on it ends after a number of requests, however fast the machine."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ClockedGeneration(ScriptedGeneration):
    clock: ServedClock = field(default_factory=ServedClock)

    async def _answer(self, script: Script, context):
        await asyncio.sleep(script.first_s)
        self.clock.now += script.first_s
        for position, size in enumerate(script.chunks):
            yield pb.GenerateEvent(chunk=pb.Chunk(token_ids=[7] * size, num_tokens=position + 1))
        yield pb.GenerateEvent(final=pb.Final(usage=pb.Usage(prompt_tokens=4, completion_tokens=1),
                                              finish_reason="length"))


@pytest.mark.asyncio
async def test_closed_loop_duration_bound():
    # 1/32 s a request (exact in binary), 0.3 s: after the 9th answer 9/32 s have
    # passed and a worker still sends; after the 10th, 10/32 s, none does. Two
    # workers: the two first requests, one more after each of the first 8
    # answers, and one after the 9th unless the other worker's answer came first.
    quick = Script(first_s=1 / 32, chunks=(1,), gap_s=0.0)
    servicer = ClockedGeneration(default=quick)
    async with AsyncExitStack() as stack:
        client = await start(servicer, stack)
        specs = closed_loop_specs(workload(), Bounds(None, 0.3))
        records = await run_closed_loop(client, specs, servicer.clock, RunCounters(None), 2, 0.3)
    assert len(records) in (10, 11), len(records)
    assert all(r.outcome == "completed" for r in records)
    first = records[0].scheduled_s
    assert max(r.scheduled_s for r in records) < first + 0.3
    assert servicer.clock.now >= first + 0.3  # it stopped because the time was up


@pytest.mark.asyncio
async def test_selfcheck_confirms_the_burst_rate_when_every_probe_is_on_schedule(monkeypatch):
    # Limits no probe can miss: the first constant-rate probe, at the burst rate, holds.
    monkeypatch.setattr(selfcheck, "LAG_LIMIT_S", math.inf)
    monkeypatch.setattr(selfcheck, "E2E_LIMIT_S", math.inf)
    check = await run_selfcheck(workload(), probe_s=0.3)
    assert check.burst_rate > 0 and check.sustained_rate == check.burst_rate
    assert check.warning(0.4 * check.sustained_rate) is None
    assert "self-check" in check.warning(0.8 * check.sustained_rate)


@pytest.mark.asyncio
async def test_selfcheck_steps_down_and_gives_no_rate_when_none_holds(monkeypatch):
    probed = []
    real_probe = selfcheck._probe

    async def counting_probe(client, specs):
        probed.append(len(specs))
        return await real_probe(client, specs)

    monkeypatch.setattr(selfcheck, "LAG_LIMIT_S", -1.0)  # no send lag is below it
    monkeypatch.setattr(selfcheck, "_probe", counting_probe)
    check = await run_selfcheck(workload(), probe_s=0.3)
    assert check.sustained_rate is None and check.warning(1e9) is None
    assert len(probed) == 1 + selfcheck.MAX_PROBES  # the burst, then each step down
    assert probed[1:] == sorted(probed[1:], reverse=True)


def test_selfcheck_warning_threshold():
    check = SelfCheck(burst_rate=400.0, sustained_rate=200.0, mean_output_tokens=32,
                      send_lag_p90_s=0.001)
    assert check.warning(100.0) is None and check.warning(None) is None
    assert "60%" in check.warning(120.0)
    assert SelfCheck(400.0, None, 32, None).warning(1000.0) is None


