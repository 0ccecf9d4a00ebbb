"""Saved results: the JSON report, the per-request CSV and the printed tables.

A report keeps the flags, the self-check, the summary and every request record
(with its chunk timeline), so `loadgen report` can recompute everything from it.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadgen.errors import UsageError
from loadgen.metrics import Stats, Summary
from loadgen.record import CSV_FIELDS, RequestRecord, csv_row

FORMAT_VERSION = 1
LATENCY_ROWS = (
    ("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"),
    ("queue (server)", "queue_s"), ("send lag", "send_lag_s"),
)


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": FORMAT_VERSION, **report}, indent=1) + "\n")


def load_report(path: str) -> dict[str, Any]:
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"{path} is not JSON: {error.msg} at line {error.lineno}") from None
    if not isinstance(report, dict) or report.get("kind") not in ("run", "sweep"):
        raise UsageError(f"{path} is not a loadgen report (no kind 'run' or 'sweep')")
    if report.get("format") != FORMAT_VERSION:
        raise UsageError(f"{path} has report format {report.get('format')!r}, "
                         f"this loadgen reads {FORMAT_VERSION}")
    return report


def records_of(data: Sequence[dict[str, Any]], where: str) -> list[RequestRecord]:
    try:
        return [RequestRecord.from_dict(item) for item in data]
    except (AttributeError, TypeError, ValueError, KeyError) as error:
        raise UsageError(f"{where}: a request record is malformed ({error})") from None


def write_csv(path: Path, groups: Sequence[tuple[dict[str, Any], Sequence[RequestRecord]]]) -> None:
    """One row per request; each group's extra columns (e.g. a sweep point's rate) go first."""
    extra_names = list(groups[0][0]) if groups else []
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*extra_names, *CSV_FIELDS])
        writer.writeheader()
        for extra, records in groups:
            writer.writerows({**extra, **csv_row(record)} for record in records)


def summary_table(summary: Summary, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for name in ("mean", "p50", "p90", "p95", "p99", "max"):
        table.add_column(f"{name} ms", justify="right")
    for label, key in LATENCY_ROWS:
        stats = summary.latency[key]
        table.add_row(label, *_ms_cells(stats))
    return table


def totals_lines(summary: Summary) -> list[str]:
    counts = summary.counts
    lines = [
        f"requests: {counts.measured} measured (+{counts.warmup} warm-up), {counts.sent} sent, "
        f"{counts.completed} completed, {counts.errors} errors, {counts.cancelled} cancelled"
        + (f", {counts.unsent} unsent" if counts.unsent else ""),
        f"window {summary.window_s:.2f}s, offered "
        + (f"{summary.offered_rate:.3g} req/s" if summary.offered_rate else "n/a")
        + f", throughput {summary.request_throughput:.3g} req/s, "
        f"{summary.output_token_throughput:.4g} output tok/s",
    ]
    if summary.prompt_tokens:
        lines.append(f"prompt tokens {summary.prompt_tokens}, {summary.cached_tokens} of them "
                     "served from the prefix cache")
    if counts.errors_by_status:
        lines.append("errors by status: " + ", ".join(
            f"{code} {n}" for code, n in counts.errors_by_status.items()))
    if summary.slo is not None and summary.slo_attainment is not None:
        lines.append(
            f"SLO {summary.slo.describe()}: attainment {summary.slo_attainment:.1%} "
            f"({summary.slo_met} met), goodput {summary.goodput or 0.0:.3g} req/s"
        )
    return lines


def print_summary(
    console: Console, summary: Summary, title: str, policy: dict[str, Any] | None
) -> None:
    console.print(summary_table(summary, title))
    for line in totals_lines(summary):
        console.print(line, highlight=False)
    for line in policy_lines(policy or {}):
        console.print(line, highlight=False)


def policy_lines(policy: dict[str, Any]) -> list[str]:
    """RequestOptions.policy() (as saved in a report) in words; none for older reports."""
    if not policy:
        return []
    salt = policy.get("cache_salt") or "one per point"
    if policy.get("prefix_cache") == "shared":
        cache = "prefix cache: shared with earlier runs (--share-prefix-cache)"
    else:
        cache = f"prefix cache: cold, a fresh cache_salt per run ({salt})"
    seeds = "seeds: requests unseeded, as clients send them"
    if policy.get("request_seeds"):
        seeds = "seeds: each request seeded from --seed (--request-seeds)"
    return [cache, seeds]


def sweep_table(points: Sequence[tuple[float, bool, Summary]], knee: float | None) -> Table:
    table = Table(title="sweep, in the order tried", title_justify="left",
                  caption="rates in req/s, latencies in ms; * the knee", caption_justify="left")
    for name in ("rate", "SLO met", "goodput", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                 "pass"):
        table.add_column(name, justify="right")
    for rate, passed, summary in points:
        ttft, tpot = summary.latency["ttft_s"], summary.latency["tpot_s"]
        table.add_row(
            f"{rate:.4g}" + (" *" if knee is not None and rate == knee else ""),
            f"{(summary.slo_attainment or 0.0):.1%}",
            f"{(summary.goodput or 0.0):.3g}",
            *(_ms(getattr(s, p) if s else None) for s in (ttft, tpot) for p in ("p50", "p99")),
            "yes" if passed else "no",
        )
    return table


def _ms_cells(stats: Stats | None) -> list[str]:
    if stats is None:
        return ["-"] * 6
    return [_ms(v) for v in (stats.mean, stats.p50, stats.p90, stats.p95, stats.p99, stats.max)]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"
