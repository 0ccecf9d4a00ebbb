"""The run's clock: seconds since the run's start, from time.perf_counter (monotonic)."""

from __future__ import annotations

import time


class RunClock:
    def __init__(self, lead_s: float = 0.0) -> None:
        # A short lead puts offset 0 slightly in the future, so the first arrival
        # is not already late while tasks and the channel warm up.
        self.start = time.perf_counter() + lead_s

    def __call__(self) -> float:
        return time.perf_counter() - self.start
