"""Open-loop arrival schedules: Poisson, gamma (with a burstiness factor) and constant rate.

Gaps are drawn at unit rate and divided by the rate, so a sweep that reuses one
seed sees the same arrival *shape* at every rate (common random numbers), which
makes neighbouring sweep points comparable. The first arrival is at offset 0.
Gamma gaps have shape = burstiness and mean 1/rate, hence a coefficient of
variation of 1/sqrt(burstiness): burstiness 1 is Poisson, < 1 burstier, > 1 smoother.
Nothing is rescaled afterwards to hit an exact total span, which would distort the
process; the report states the offered rate actually realised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

ARRIVAL_STREAM = 1  # the seed-sequence branch for arrivals, apart from request content
_BLOCK = 1024  # gaps drawn per numpy call; fixed so the sequence is independent of use

UnitGaps = Callable[[np.random.Generator, float, int], np.ndarray]

KINDS: dict[str, UnitGaps] = {
    "poisson": lambda rng, burstiness, n: rng.exponential(1.0, n),
    "gamma": lambda rng, burstiness, n: rng.gamma(burstiness, 1.0 / burstiness, n),
    "constant": lambda rng, burstiness, n: np.ones(n),
}


def arrival_offsets(kind: str, rate: float, seed: int, burstiness: float = 1.0) -> Iterator[float]:
    """Endless scheduled arrival offsets in seconds: 0, then cumulative gaps of mean 1/rate."""
    draw = KINDS[kind]
    rng = np.random.default_rng([seed, ARRIVAL_STREAM])
    offset = 0.0
    while True:
        for gap in draw(rng, burstiness, _BLOCK):
            yield offset
            offset += float(gap) / rate
