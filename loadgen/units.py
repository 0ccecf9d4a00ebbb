"""Durations with units ("2000ms", "1.5s", "250us") into seconds."""

from __future__ import annotations

import math
import re

from loadgen.errors import UsageError

UNIT_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*$")


def parse_seconds(text: str, what: str, bare_is_seconds: bool = True) -> float:
    """Seconds from "10s", "500ms", "250us", "2m"; a bare number is seconds when allowed.

    SLO bounds pass bare_is_seconds=False: "ttft=200" could mean ms or s, and guessing
    wrong by 1000x would silently pass or fail every request.
    """
    match = _DURATION.match(text)
    if match is None:
        raise UsageError(f"{what}: {text!r} is not a duration such as 500ms or 2s")
    number, unit = match.groups()
    if unit == "" and bare_is_seconds:
        unit = "s"
    if unit not in UNIT_SECONDS:
        units = ", ".join(UNIT_SECONDS)
        raise UsageError(f"{what}: {text!r} needs a unit, one of {units}")
    seconds = float(number) * UNIT_SECONDS[unit]
    if not math.isfinite(seconds):
        raise UsageError(f"{what}: {text!r} is not finite")
    return seconds
