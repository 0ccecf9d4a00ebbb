"""Find the knee: the highest arrival rate whose SLO attainment stays at the target.

Like MLPerf LoadGen's Server scenario, each rate is a full run judged at the
latency constraints (here: the fraction of requests meeting every SLO must stay
>= the target, 99% by default). Start at start_rate and double until a rate fails
(or halve until one passes), then bisect the bracket a few times. The answer is
the highest rate that passed; the curve is every rate tried.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Passes = Callable[[float], Awaitable[bool]]


@dataclass(frozen=True)
class SweepPlan:
    start_rate: float
    bisect_steps: int = 3
    max_steps: int = 8  # doublings (or halvings) before giving up on a bracket

    def __post_init__(self) -> None:
        assert self.start_rate > 0 and self.bisect_steps >= 0 and self.max_steps >= 1


@dataclass(frozen=True)
class Knee:
    rate: float | None  # highest passing rate; None: even the lowest tried failed
    failed_rate: float | None  # lowest failing rate above it; None: never failed


async def find_knee(plan: SweepPlan, passes: Passes) -> Knee:
    """Bracket by doubling (or halving), then bisect; `passes` runs one full point."""
    passed, failed = await _bracket(plan, passes)
    if passed is None or failed is None:
        return Knee(passed, failed)
    for _ in range(plan.bisect_steps):
        middle = (passed + failed) / 2
        if await passes(middle):
            passed = middle
        else:
            failed = middle
    return Knee(passed, failed)


async def _bracket(plan: SweepPlan, passes: Passes) -> tuple[float | None, float | None]:
    rate = plan.start_rate
    if await passes(rate):
        for _ in range(plan.max_steps):
            if not await passes(rate * 2):
                return rate, rate * 2
            rate *= 2
        return rate, None
    for _ in range(plan.max_steps):
        if await passes(rate / 2):
            return rate / 2, rate
        rate /= 2
    return None, rate
