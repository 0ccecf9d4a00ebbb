"""A live one-line status during a run (rich), off with --no-progress or when stdout is no TTY."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.live import Live
from rich.text import Text

from loadgen.clock import RunClock
from loadgen.runner import RunCounters

REFRESH_PER_SECOND = 4


def progress_wanted(disabled: bool) -> bool:
    return not disabled and sys.stdout.isatty()


@contextmanager
def live_progress(
    counters: RunCounters, clock: RunClock, title: str, enabled: bool
) -> Iterator[None]:
    """Show counters while the body runs; a no-op when not enabled."""
    if not enabled:
        yield
        return
    # Live's own refresh thread reads plain ints: a torn read only misprints one frame.
    with Live(
        get_renderable=lambda: _status(counters, clock, title),
        console=Console(),
        refresh_per_second=REFRESH_PER_SECOND,
        transient=True,
    ):
        yield


def _status(counters: RunCounters, clock: RunClock, title: str) -> Text:
    planned = "?" if counters.planned is None else str(counters.planned)
    line = Text()
    line.append(f"{title} ", style="bold")
    line.append(f"{max(0.0, clock()):6.1f}s  sent {counters.sent}/{planned}  ")
    line.append(f"in flight {counters.in_flight}  ", style="cyan")
    line.append(f"done {counters.completed}  ", style="green")
    line.append(f"errors {counters.errors}  ", style="red" if counters.errors else "")
    line.append(f"cancelled {counters.cancelled}  tokens {counters.tokens}  ")
    line.append(f"max send lag {counters.max_send_lag_s * 1000:.1f}ms")
    return line
