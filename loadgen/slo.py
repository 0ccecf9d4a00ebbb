"""Latency SLOs (`ttft=2000ms,tpot=200ms,e2e=10s`) and the per-request check against them."""

from __future__ import annotations

from dataclasses import dataclass

from loadgen.errors import UsageError
from loadgen.units import parse_seconds

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class Slo:
    """Upper bounds in seconds; None leaves that metric unconstrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None) -> bool:
        """True when every given bound holds.

        A missing TTFT or E2E (no token, no end) fails. A missing TPOT (one output
        token) passes: there was no second token that could have been late.
        """
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        if self.tpot_s is not None and tpot_s is not None and tpot_s > self.tpot_s:
            return False
        return self.e2e_s is None or (e2e_s is not None and e2e_s <= self.e2e_s)

    def describe(self) -> str:
        parts = [
            f"{key}={value * 1000:g}ms"
            for key, value in zip(SLO_KEYS, (self.ttft_s, self.tpot_s, self.e2e_s), strict=True)
            if value is not None
        ]
        return ",".join(parts)


def parse_slo(text: str) -> Slo:
    """`ttft=2000ms,tpot=200ms,e2e=10s` -> Slo; every bound needs a unit (us, ms, s, m)."""
    bounds: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip().lower()
        if not sep or not value.strip():
            raise UsageError(f"--slo: {part.strip()!r} is not KEY=DURATION (e.g. ttft=2000ms)")
        if key not in SLO_KEYS:
            raise UsageError(f"--slo: unknown key {key!r}; known: {', '.join(SLO_KEYS)}")
        if f"{key}_s" in bounds:
            raise UsageError(f"--slo: {key} is given twice")
        seconds = parse_seconds(value.strip(), f"--slo {key}", bare_is_seconds=False)
        if seconds <= 0:
            raise UsageError(f"--slo: {key} must be > 0, got {value.strip()!r}")
        bounds[f"{key}_s"] = seconds
    return Slo(**bounds)
