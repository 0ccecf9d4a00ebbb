"""PNG figures (matplotlib, Agg, no pyplot state): latency CDFs and the sweep curve."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from loadgen.metrics import Summary
from loadgen.record import RequestRecord
from loadgen.slo import Slo

CDF_PANELS = (("TTFT", "ttft_s", "ttft_s"), ("TPOT", "tpot_s", "tpot_s"), ("E2E", "e2e_s", "e2e_s"))


def latency_cdf(path: Path, records: Sequence[RequestRecord], slo: Slo | None, title: str) -> None:
    """TTFT, TPOT and E2E CDFs of the completed measured requests, with p50/p99 marked."""
    done = [r for r in records if not r.warmup and r.outcome == "completed"]
    figure = Figure(figsize=(13, 4), layout="constrained")
    figure.suptitle(title)
    for axes, (label, attribute, slo_key) in zip(figure.subplots(1, 3), CDF_PANELS, strict=True):
        values = np.sort([v for r in done if (v := getattr(r, attribute)) is not None]) * 1000
        bound = getattr(slo, slo_key) if slo is not None else None
        _cdf_panel(axes, values, label, None if bound is None else bound * 1000)
    _save(figure, path)


def sweep_curve(
    path: Path, points: Sequence[tuple[float, Summary]], knee: float | None, slo: Slo | None
) -> None:
    """TTFT and TPOT p50/p99, throughput and goodput against the offered rate."""
    points = sorted(points, key=lambda point: point[0])
    rates = [rate for rate, _ in points]
    figure = Figure(figsize=(13, 4), layout="constrained")
    figure.suptitle("sweep: latency and goodput against offered load")
    ttft_axes, tpot_axes, good_axes = figure.subplots(1, 3)
    for axes, key, label, bound in (
        (ttft_axes, "ttft_s", "TTFT", slo.ttft_s if slo else None),
        (tpot_axes, "tpot_s", "TPOT", slo.tpot_s if slo else None),
    ):
        for quantile, style in (("p50", "o-"), ("p99", "s--")):
            values = [_stat_ms(summary, key, quantile) for _, summary in points]
            axes.plot(rates, values, style, label=f"{label} {quantile}")
        if bound is not None:
            axes.axhline(bound * 1000, color="red", linewidth=0.8, label="SLO")
        axes.set(xlabel="offered rate (req/s)", ylabel="ms", title=label)
    good_axes.plot(rates, [s.request_throughput for _, s in points], "o-", label="throughput")
    good_axes.plot(rates, [s.goodput or 0.0 for _, s in points], "s--", label="goodput")
    good_axes.plot(rates, rates, ":", color="grey", label="offered")
    good_axes.set(xlabel="offered rate (req/s)", ylabel="req/s", title="goodput")
    for axes in (ttft_axes, tpot_axes, good_axes):
        if knee is not None:
            axes.axvline(knee, color="green", linewidth=0.8, label=f"knee {knee:.3g}")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    _save(figure, path)


def _cdf_panel(axes: Axes, values_ms: np.ndarray, label: str, bound_ms: float | None) -> None:
    axes.set(title=label, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
    axes.grid(alpha=0.3)
    if values_ms.size == 0:
        axes.text(0.5, 0.5, "no data", ha="center", transform=axes.transAxes)
        return
    fractions = np.arange(1, values_ms.size + 1) / values_ms.size
    axes.step(values_ms, fractions, where="post")
    for quantile, style in ((50, ":"), (99, "--")):
        value = float(np.percentile(values_ms, quantile))
        axes.axvline(value, linestyle=style, color="grey", label=f"p{quantile} {value:.1f} ms")
    if bound_ms is not None:
        axes.axvline(bound_ms, color="red", linewidth=0.8, label=f"SLO {bound_ms:g} ms")
    axes.legend(fontsize="small", loc="lower right")


def _stat_ms(summary: Summary, key: str, quantile: str) -> float:
    stats = summary.latency[key]
    return float("nan") if stats is None else getattr(stats, quantile) * 1000


def _save(figure: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=110)
