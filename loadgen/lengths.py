"""Synthetic prompt/output length distributions: fixed, uniform, normal, lognormal.

Written as `32`, `fixed:32`, `uniform:16,64` (inclusive), `normal:MEAN,STD` or
`lognormal:MEAN,SIGMA` (MEAN of the lengths themselves, SIGMA of their log).
Samples are rounded and clipped to >= 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loadgen.errors import UsageError

Sampler = Callable[[np.random.Generator, tuple[float, ...]], float]


def _fixed(rng: np.random.Generator, p: tuple[float, ...]) -> float:
    return p[0]


def _uniform(rng: np.random.Generator, p: tuple[float, ...]) -> float:
    return float(rng.integers(int(p[0]), int(p[1]), endpoint=True))


def _normal(rng: np.random.Generator, p: tuple[float, ...]) -> float:
    return float(rng.normal(p[0], p[1]))


def _lognormal(rng: np.random.Generator, p: tuple[float, ...]) -> float:
    # Choose mu so that the lengths, not their logs, have the requested mean.
    mean, sigma = p
    return float(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma))


# kind -> (number of parameters, sampler)
KINDS: dict[str, tuple[int, Sampler]] = {
    "fixed": (1, _fixed),
    "uniform": (2, _uniform),
    "normal": (2, _normal),
    "lognormal": (2, _lognormal),
}


@dataclass(frozen=True)
class LengthDistribution:
    kind: str
    params: tuple[float, ...]

    def sample(self, rng: np.random.Generator) -> int:
        return max(1, round(KINDS[self.kind][1](rng, self.params)))

    @property
    def mean(self) -> float:
        """The nominal mean (before clipping), for sizing and for the report."""
        if self.kind == "uniform":
            return (self.params[0] + self.params[1]) / 2
        return self.params[0]

    def describe(self) -> str:
        return f"{self.kind}:{','.join(f'{p:g}' for p in self.params)}"


def parse_lengths(text: str, what: str) -> LengthDistribution:
    """Parse `32`, `fixed:32`, `uniform:16,64`, `normal:32,8` or `lognormal:32,0.5`."""
    kind, sep, rest = text.strip().partition(":")
    if not sep:
        kind, rest = "fixed", text.strip()
    if kind not in KINDS:
        raise UsageError(f"{what}: unknown distribution {kind!r}; known: {', '.join(KINDS)}")
    count = KINDS[kind][0]
    try:
        params = tuple(float(p) for p in rest.split(","))
    except ValueError:
        raise UsageError(f"{what}: {text!r} has a parameter that is not a number") from None
    if len(params) != count or not all(math.isfinite(p) for p in params):
        raise UsageError(f"{what}: {kind} takes {count} finite number(s), got {text!r}")
    _check(kind, params, what, text)
    return LengthDistribution(kind, params)


def _check(kind: str, params: tuple[float, ...], what: str, text: str) -> None:
    if params[0] < 1:
        raise UsageError(f"{what}: the first parameter must be >= 1 in {text!r}")
    if kind == "uniform" and params[1] < params[0]:
        raise UsageError(f"{what}: uniform needs LOW <= HIGH, got {text!r}")
    if kind in ("normal", "lognormal") and params[1] < 0:
        raise UsageError(f"{what}: the spread must be >= 0 in {text!r}")
