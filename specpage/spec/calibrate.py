"""Start-up measurement of forward costs, for the speculation policy.

Whether k proposals pay depends on what k more target positions cost next to
the positions the batch computes anyway. A curve fitted online sees one batch
size for long stretches and cannot tell that slope, so the engine times both
models once, over position counts from one up to the most a step can verify,
and the policy interpolates (`policy.CostCurve`). Single timings on a shared
machine are noisy, so the curve handed to the policy is a least-squares fit
of a few straight segments through all of them, not the points themselves: a
noisy point would otherwise make the positions after it look free.

The timed forwards write K/V into pool blocks; at start-up every block is
free, and a block's content counts only once a sequence has written it.
"""

from __future__ import annotations

import itertools
import math
import time

import torch

from specpage.model_runner import ModelRunner, SeqSpan

CONTEXT = 128  # positions each timed span attends to before its own, a chat-sized history
MAX_POSITIONS = 64  # beyond this the curve continues along its last segment
# Up to SMALL positions every size is a knot and is timed REPEATS times (the
# least counts): there the curve has steps (a forward pads 1 row to 2 and 3 to
# 4, so a second position can be free), and a step is what k = 1 costs alone.
SMALL = 8
REPEATS = 3
KNOTS = (16, 32, 64)  # beyond SMALL, where the fitted segments meet (and at the largest size)


def calibration_sizes(limit: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... up to limit (itself included)."""
    limit = max(1, min(limit, MAX_POSITIONS))
    sizes = {n for n in (1, 2, 3) if n < limit} | {limit}
    power = 4
    while power < limit:
        sizes.update(n for n in (power, power * 3 // 2) if n < limit)
        power *= 2
    return sorted(sizes)


def measure_forwards(
    runner: ModelRunner, sizes: list[int], max_rows: int, num_blocks: int,
    max_context: int, every_logit: bool,
) -> list[tuple[int, float]]:
    """(positions, seconds) of one forward per size. Positions are spread over
    up to max_rows sequences (decode-like rows first, then verify-like spans)
    after up to CONTEXT earlier positions each, with logits for every
    position (target) or the last (draft)."""
    blocks = itertools.count()
    context = max(0, min(CONTEXT, max_context - max(sizes)))

    def spans(size: int) -> list[SeqSpan]:
        rows = min(size, max_rows)
        result = []
        for row in range(rows):
            length = size // rows + (row < size % rows)
            table = [next(blocks) % num_blocks
                     for _ in range(math.ceil((context + length) / runner.block_size))]
            result.append(SeqSpan([0] * length, context, table,
                                  num_logits=length if every_logit else 1))
        return result

    runner.forward(spans(1))  # first-call costs are not a step's
    points = []
    for size in sizes:
        batch, best = spans(size), math.inf
        for _ in range(REPEATS if size <= SMALL else 1):
            start = time.perf_counter()
            runner.forward(batch)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            best = min(best, time.perf_counter() - start)
        points.append((size, best))
    return points


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
