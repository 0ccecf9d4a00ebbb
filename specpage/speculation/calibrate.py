"""Start-up measurement of forward costs, for the speculation policy.

Whether k proposals pay depends on what k more target positions cost next to
the positions the batch computes anyway. A curve fitted online sees one batch
size for long stretches and cannot tell that slope, so the engine times both
models once, over position counts from one up to the most a step can verify,
and the policy interpolates (`policy.CostCurve`). Single timings on a shared
machine are noisy, so the curve handed to the policy is a least-squares fit
of a few straight segments through all of them, not the points themselves: a
noisy point would otherwise make the positions after it look free. What
noise remains, the policy corrects from the forwards it runs.

The measurement has a time budget: on a busy machine a forward can take ten
times as long, and a daemon should not spend minutes starting. Sizes are
timed in order of use (1, 2, the largest, then the rest), both models at each
size, and repeats come in later rounds, so that a short budget leaves fewer
sizes and repeats rather than one model unmeasured, and repeats of a size fall
at different moments of a busy machine.

The timed forwards write K/V into pool blocks; at start-up every block is
free, and a block's content counts only once a sequence has written it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpage.core.span import Span
from specpage.speculation.runner import SpanRunner

CONTEXT = 128  # positions each timed span attends to before its own, a chat-sized history
MAX_POSITIONS = 64  # beyond this the curve continues along its last segment
# Up to SMALL positions every size is a knot and is timed REPEATS times (the
# least counts): there the curve has steps (a forward pads 1 row to 2 and 3 to
# 4, so a second position can be free), and a step is what k = 1 costs alone.
SMALL = 8
REPEATS = 3
KNOTS = (16, 32, 64)  # beyond SMALL, where the fitted segments meet (and at the largest size)
# Seconds for timing both models at start-up; the warm-up forwards, and a
# forward that runs longer than predicted, come on top. Unhurried, both models
# of the default pair take about 2.5 s on a 2-core machine; beside other work
# a forward takes up to ten times as long, and the budget then leaves out
# repeats and sizes (a forward predicted to overrun it is not started).
BUDGET = 3.5


def calibration_sizes(limit: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... up to limit (itself included)."""
    limit = max(1, min(limit, MAX_POSITIONS))
    sizes = {n for n in (1, 2, 3) if n < limit} | {limit}
    power = 4
    while power < limit:
        sizes.update(n for n in (power, power * 3 // 2) if n < limit)
        power *= 2
    return sorted(sizes)


@dataclass(frozen=True)
class Plan:
    """What to time: position counts, spread over up to max_rows sequences
    (decode-like rows first, then verify-like spans) after `context` earlier
    positions each, in blocks below num_blocks."""

    sizes: tuple[int, ...]
    max_rows: int
    num_blocks: int
    context: int

    @classmethod
    def make(cls, sizes: Sequence[int], max_rows: int, num_blocks: int,
             max_context: int) -> Plan:
        return cls(tuple(sizes), max_rows, num_blocks,
                   max(0, min(CONTEXT, max_context - max(sizes))))

    def order(self) -> list[int]:
        """Sizes in the order a short budget should keep them: one position,
        two (whether a second is free), the largest (the slope), the rest."""
        first = [n for n in (1, 2, max(self.sizes)) if n in self.sizes]
        return list(dict.fromkeys(first + list(self.sizes)))

    def spans(self, runner: SpanRunner, size: int, every_logit: bool) -> list[Span]:
        """The same blocks for every forward of a size: repeats find their
        pages written, as a running pool's are."""
        rows, block = min(size, self.max_rows), 0
        result = []
        for row in range(rows):
            length = size // rows + (row < size % rows)
            count = math.ceil((self.context + length) / runner.block_size)
            table = [(block + i) % self.num_blocks for i in range(count)]
            block += count
            # every layer group the same blocks: only the time is wanted
            result.append(Span([0] * length, self.context, table,
                               num_logits=length if every_logit else 1,
                               group_tables=[table] * (runner.group_count - 1)))
        return result


class Measured(dict[int, float]):
    """Least seconds seen per size, for one model."""

    def points(self) -> list[tuple[int, float]]:
        return sorted(self.items())

    def predict(self, size: int, fallback: float) -> float:
        """Seconds a forward of this size should take: the nearest smaller
        size's, scaled up in proportion (forwards grow less than that)."""
        smaller = [n for n in self if n <= size]
        if not smaller:
            return fallback * size
        n = max(smaller)
        return self[n] * size / n


def measure(runners: Sequence[tuple[SpanRunner, bool]], plan: Plan,
            budget: float = BUDGET) -> list[Measured]:
    """Time a forward of each size for each (runner, every_logit) within
    budget seconds: logits for every position (the target's verification) or
    the last (the draft). Sizes up to SMALL are timed REPEATS times, the least
    counts."""
    deadline = time.perf_counter() + budget
    results = [Measured() for _ in runners]
    first = []
    for runner, every_logit in runners:  # first-call costs are not a step's
        first.append(_timed(runner, plan.spans(runner, 1, every_logit)))
    for repeat in range(REPEATS):
        sizes = plan.order() if repeat == 0 else [n for n in plan.sizes if n <= SMALL]
        for size in sizes:
            for (runner, every_logit), result, warm_up in zip(runners, results, first,
                                                                strict=True):
                if time.perf_counter() + result.predict(size, warm_up) > deadline:
                    continue
                seconds = _timed(runner, plan.spans(runner, size, every_logit))
                result[size] = min(result.get(size, math.inf), seconds)
    return results


def _timed(runner: SpanRunner, spans: list[Span]) -> float:
    if getattr(runner, "graphs", None) is not None:
        # a shape's first forward captures its CUDA graph (executor/cuda_graphs.py):
        # a cost paid once, not a step's
        runner.forward(spans)
    start = time.perf_counter()
    runner.forward(spans)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start


def fit_segments(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Least-squares fit (relative errors) of straight segments meeting at
    each size up to SMALL, at KNOTS and at the largest size; returns the
    fitted (size, seconds) at those sizes, non-decreasing."""
    sizes = torch.tensor([float(n) for n, _ in points], dtype=torch.float64)
    seconds = torch.tensor([s for _, s in points], dtype=torch.float64)
    last = float(sizes.max())
    small = [float(n) for n, _ in points if n <= SMALL]
    knots = sorted({*small, *(float(k) for k in KNOTS if SMALL < k < last), last})
    hinges = knots[:-1]  # a segment starts at each; the first basis column is the level

    def basis(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.ones_like(x)] + [(x - h).clamp(min=0) for h in hinges], -1)

    weight = 1 / seconds.clamp(min=1e-9)
    solution = torch.linalg.lstsq(basis(sizes) * weight[:, None], (seconds * weight)[:, None],
                                  driver="gelsd").solution
    fitted = (basis(torch.tensor(knots, dtype=torch.float64)) @ solution).squeeze(-1).tolist()
    result, floor = [], 0.0
    for knot, value in zip(knots, fitted, strict=True):
        floor = max(floor, value)
        result.append((int(knot), floor))
    return result
