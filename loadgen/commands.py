"""The subcommands: run, sweep, report and selfcheck, from parsed flags to files and tables."""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from loadgen import plots
from loadgen.arrivals import arrival_offsets
from loadgen.backend import Backend
from loadgen.client import Client
from loadgen.clock import RunClock
from loadgen.errors import UsageError
from loadgen.metrics import Summary, summarize
from loadgen.openai_client import OpenAIClient
from loadgen.options import RunSettings, output_folder, run_settings, workload
from loadgen.progress import live_progress, progress_wanted
from loadgen.record import RequestRecord
from loadgen.report import (
    load_report,
    policy_lines,
    print_summary,
    records_of,
    sweep_table,
    write_csv,
    write_json,
)
from loadgen.runner import RunCounters, run_closed_loop, run_open_loop
from loadgen.schedule import closed_loop_specs, plan_open_loop, plan_trace
from loadgen.selfcheck import SelfCheck, run_selfcheck
from loadgen.slo import Slo, parse_slo
from loadgen.sweep import SweepPlan, find_knee

CLOCK_LEAD_S = 0.05  # the first arrival is this far in the future when the clock starts
LAG_WARN_S = 0.010  # p99 send lag above this means the client did not keep the schedule


async def run(args: argparse.Namespace) -> int:
    settings = run_settings(args)
    client = _client(settings)
    try:
        await client.connect(settings.health_timeout_s)  # before the self-check: fail fast
        check = await _maybe_selfcheck(settings, args.no_selfcheck)
        records = await drive(client, settings, _describe(settings), not args.no_progress)
    finally:
        await client.close()
    summary = summarize(records, settings.slo)
    warnings = _warnings(settings, check, summary)
    report = _report("run", settings, check, warnings) | {
        "target": client.describe(), "policy": settings.request.policy(),
        "summary": summary.to_dict(), "records": [r.to_dict() for r in records],
    }
    write_json(settings.out / "report.json", report)
    write_csv(settings.out / "records.csv", [({}, records)])
    if not args.no_plots:
        plots.latency_cdf(settings.out / "latency_cdf.png", records, settings.slo,
                          _describe(settings))
    print_summary(Console(), summary, _describe(settings), settings.request.policy())
    _print_warnings(warnings)
    print(f"results in {settings.out}/", file=sys.stderr)
    return 0


async def sweep(args: argparse.Namespace) -> int:
    settings = run_settings(args, sweeping=True)
    if settings.slo is None:
        raise UsageError("a sweep judges each rate against SLOs: give --slo")
    if not 0 < args.target_attainment <= 100:
        raise UsageError(f"--target-attainment is a percentage in (0, 100], "
                         f"got {args.target_attainment:g}")
    if not args.start_rate > 0 or args.bisect_steps < 0 or args.max_steps < 1:
        raise UsageError("need --start-rate > 0, --bisect-steps >= 0 and --max-steps >= 1")
    target = float(args.target_attainment) / 100
    points: list[tuple[float, bool, Summary, list[RequestRecord]]] = []
    salts: list[str] = []  # each point's cache namespace, by index
    client = _client(settings)

    async def passes(rate: float) -> bool:
        # Each point is its own run: a later point must not find the earlier ones' prompts cached.
        point = dataclasses.replace(settings, load=dataclasses.replace(settings.load, rate=rate),
                                    request=settings.request.for_new_run())
        records = await drive(client, point, f"sweep {rate:.4g} req/s", not args.no_progress)
        summary = summarize(records, settings.slo)
        passed = (summary.slo_attainment or 0.0) >= target
        points.append((rate, passed, summary, records))
        salts.append(point.request.cache_salt)
        print(f"rate {rate:.4g} req/s: attainment {summary.slo_attainment or 0.0:.1%} "
              f"-> {'pass' if passed else 'fail'}", file=sys.stderr)
        return passed

    try:
        await client.connect(settings.health_timeout_s)
        check = await _maybe_selfcheck(settings, args.no_selfcheck)
        plan = SweepPlan(args.start_rate, args.bisect_steps, args.max_steps)
        knee = await find_knee(plan, passes)
    finally:
        await client.close()
    warnings = [w for rate, _, s, _ in points for w in _warnings(settings, check, s, rate)]
    policy = settings.request.policy() | {"cache_salt": ""}  # each point has its own
    report = _report("sweep", settings, check, warnings) | {
        "target": client.describe(), "policy": policy,
        "sweep": {"target_attainment": target, "knee_rate": knee.rate,
                  "failed_rate": knee.failed_rate},
        "points": [{"rate": rate, "passed": passed, "cache_salt": salt,
                    "summary": summary.to_dict(), "records": [r.to_dict() for r in records]}
                   for (rate, passed, summary, records), salt in zip(points, salts, strict=True)],
    }
    write_json(settings.out / "sweep.json", report)
    write_csv(settings.out / "records.csv", [({"point_rate": p[0]}, p[3]) for p in points])
    _render_sweep(settings.out, points, knee.rate, settings.slo, not args.no_plots)
    for line in policy_lines(policy):
        print(line, file=sys.stderr)
    _print_warnings(warnings)
    print(f"knee: {knee.rate if knee.rate is not None else 'none'} req/s; "
          f"results in {settings.out}/", file=sys.stderr)
    return 0


async def report(args: argparse.Namespace) -> int:
    saved = load_report(args.report)
    config = saved.get("config", {})
    slo_text = args.slo if args.slo is not None else config.get("slo")
    slo = parse_slo(slo_text) if slo_text else None
    out = output_folder(args.out) if args.out else Path(args.report).parent
    if saved["kind"] == "run":
        records = records_of(saved.get("records", []), args.report)
        summary = summarize(records, slo)
        title = f"{Path(args.report).name}, {saved.get('created', '')}"
        print_summary(Console(), summary, title, saved.get("policy"))
        plots.latency_cdf(out / "latency_cdf.png", records, slo, title)
        return 0
    target = float(saved.get("sweep", {}).get("target_attainment", 0.99))
    points = []
    for point in saved.get("points", []):
        records = records_of(point.get("records", []), args.report)
        summary = summarize(records, slo)
        passed = (summary.slo_attainment or 0.0) >= target
        points.append((_point_rate(point, args.report), passed, summary, records))
    _render_sweep(out, points, knee_of(points), slo, True)
    for line in policy_lines(saved.get("policy") or {}):
        print(line)
    return 0


def _point_rate(point: dict[str, Any], where: str) -> float:
    rate = point.get("rate")
    if not isinstance(rate, int | float) or rate <= 0:
        raise UsageError(f"{where}: a sweep point has no valid rate")
    return float(rate)


async def selfcheck(args: argparse.Namespace) -> int:
    work = workload(args)
    if work.requests is not None:
        work.requests.check_grpc()  # the null target is a gRPC server
    check = await run_selfcheck(work)
    print(_selfcheck_line(check))
    return 0


async def drive(
    client: Backend, settings: RunSettings, title: str, progress: bool
) -> list[RequestRecord]:
    """One run's requests through the client; returns their records."""
    load, bounds, work = settings.load, settings.bounds, settings.workload
    client.options = settings.request  # this run's cache namespace
    show = progress_wanted(disabled=not progress)
    if load.concurrency is not None:
        counters, clock = RunCounters(planned=None), RunClock(CLOCK_LEAD_S)
        with live_progress(counters, clock, title, show):
            specs = closed_loop_specs(work, bounds, load.trace)
            return await run_closed_loop(
                client, specs, clock, counters, load.concurrency, bounds.duration_s
            )
    if load.trace is not None:
        planned = plan_trace(work, load.trace, bounds)
    else:
        assert load.rate is not None
        offsets = arrival_offsets(load.arrival, load.rate, work.seed, load.burstiness)
        planned = plan_open_loop(work, offsets, bounds)
    # The clock starts after planning, which takes a while for long runs.
    counters, clock = RunCounters(planned=len(planned)), RunClock(CLOCK_LEAD_S)
    with live_progress(counters, clock, title, show):
        return await run_open_loop(client, planned, clock, counters, settings.max_inflight)


def knee_of(points: list[tuple[float, bool, Summary, list[RequestRecord]]]) -> float | None:
    """The highest passing rate below the lowest failing one (re-judging saved points)."""
    failing = min((rate for rate, passed, _, _ in points if not passed), default=float("inf"))
    return max((rate for rate, passed, _, _ in points if passed and rate < failing), default=None)


def _render_sweep(
    out: Path, points: list[tuple[float, bool, Summary, list[RequestRecord]]],
    knee: float | None, slo: Slo | None, draw: bool,
) -> None:
    Console().print(sweep_table([(rate, passed, s) for rate, passed, s, _ in points], knee))
    if not draw or not points:
        return
    plots.sweep_curve(out / "sweep.png", [(rate, s) for rate, _, s, _ in points], knee, slo)
    chosen = knee if knee is not None else min(rate for rate, *_ in points)
    records = next(r for rate, _, _, r in points if rate == chosen)
    plots.latency_cdf(out / "latency_cdf.png", records, slo, f"sweep point {chosen:.4g} req/s")


async def _maybe_selfcheck(settings: RunSettings, disabled: bool) -> SelfCheck | None:
    if disabled:
        return None
    if settings.target.api != "grpc":
        # Its null target is a gRPC server: a figure for the gRPC client would say
        # nothing about the HTTP one.
        print("self-check: skipped, it measures the gRPC client only", file=sys.stderr)
        return None
    check = await run_selfcheck(settings.workload)
    print(_selfcheck_line(check), file=sys.stderr)
    return check


def _selfcheck_line(check: SelfCheck) -> str:
    if check.sustained_rate is not None:
        kept = (f"this client sustains {check.sustained_rate:.4g} req/s on schedule "
                "against a null target")
    else:
        kept = ("no probed rate stayed on schedule against a null target (the machine may be "
                "busy), so no rate warning is given")
    return (f"self-check: {kept} (burst {check.burst_rate:.4g} req/s, "
            f"{check.mean_output_tokens:g} one-token chunks per request)")


def _client(settings: RunSettings) -> Backend:
    run_tag = secrets.token_hex(3)
    if settings.target.api == "grpc":
        return Client(settings.target, settings.request, run_tag)
    # One connection per request that may be in flight, so none waits for the pool.
    load = settings.load
    connections = load.concurrency if load.concurrency is not None else settings.max_inflight
    return OpenAIClient(settings.target, settings.request, run_tag, connections)


def _warnings(
    settings: RunSettings, check: SelfCheck | None, summary: Summary, rate: float | None = None
) -> list[str]:
    warnings = []
    offered = rate or settings.load.rate or summary.offered_rate or summary.request_throughput
    if check is not None and (warning := check.warning(offered)):
        warnings.append(warning)
    lag = summary.latency["send_lag_s"]
    if settings.load.concurrency is None and lag is not None and lag.p99 > LAG_WARN_S:
        warnings.append(
            f"requests went out late (p99 send lag {lag.p99 * 1000:.1f} ms"
            + (f" at {rate:.4g} req/s" if rate else "")
            + "): latencies still count from the scheduled times, but the client "
            "or --max-inflight shaped the offered load"
        )
    if settings.load.concurrency is not None:
        warnings.append("closed loop: each request waits for the previous one, so server "
                        "stalls are partly hidden (coordinated omission); use --rate to see them")
    return warnings


def _print_warnings(warnings: list[str]) -> None:
    for warning in dict.fromkeys(warnings):
        print(f"warning: {warning}", file=sys.stderr)


def _report(
    kind: str, settings: RunSettings, check: SelfCheck | None, warnings: list[str]
) -> dict[str, Any]:
    return {
        "kind": kind,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": settings.config,
        "selfcheck": asdict(check) if check is not None else None,
        "warnings": list(dict.fromkeys(warnings)),
    }


def _describe(settings: RunSettings) -> str:
    load = settings.load
    if load.concurrency is not None:
        return f"closed loop, concurrency {load.concurrency}"
    if load.trace is not None:
        return f"trace replay ({len(load.trace)} entries)"
    shape = f"gamma(burstiness {load.burstiness:g})" if load.arrival == "gamma" else load.arrival
    return f"{shape} arrivals at {load.rate:g} req/s"
