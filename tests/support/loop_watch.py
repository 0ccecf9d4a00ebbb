"""How late the event loop was while a test ran, for timing tests that must
hold on a busy machine."""

from __future__ import annotations

import asyncio
import time

TICK_S = 0.005


class LoopWatch:
    """Measures how late the event loop was while a test ran.

    Client and server share the loop, so a pause of the process (another job on
    the machine, a collection) delays the measured times by as much as it delays
    this watcher's ticks. `late_s` sums every tick's lateness beyond a millisecond:
    the most that pauses can have added to any single measured interval. On a quiet
    machine it is near zero and the bounds stay tight; a test's tolerance is its
    own bound plus `late_s`, never a looser constant.
    """

    def __init__(self) -> None:
        self.late_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(TICK_S)
            self.late_s += max(0.0, time.perf_counter() - before - TICK_S - 0.001)

    async def __aenter__(self) -> LoopWatch:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
