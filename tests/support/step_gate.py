"""A gate on a daemon subprocess's engine step, worked from the test process,
so a test acts at a chosen step boundary instead of racing the clock: while
the gate is closed the daemon runs only the steps the test allows, so a
request can neither finish nor reach a deadline's check before the test says.

`python -m tests.support.step_gate serve --config ...` is `specpage serve` with the
gate in its folder ($SPECPAGE_TEST_STEP_GATE). The two processes share two
files, each written by one side only and replaced whole:
- `allowed` (the test's): absent or "open", or how many steps may have
  passed the gate since it was first closed;
- `state` (the daemon's, JSON): the steps passed while closed (`taken`),
  whether a step waits at the gate now (`held`), and the requests admitted
  since the daemon started (`admitted`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "SPECPAGE_TEST_STEP_GATE"
POLL_S = 0.002
# A held step that is never let go fails the test (the step raises, the
# call ends INTERNAL) instead of hanging it; so does a state never reached.
GATE_TIMEOUT_S = 60.0


def _write(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)  # a reader sees the old text or the new, never a part


# ---------------------------------------------------------------------- the test's end


class StepGate:
    """The test's end of the gate. Open until closed; close it from open."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._allowed = 0

    def close(self) -> None:
        """From the next step on, each step waits until allowed. The daemon
        counts no step while the gate is open, so `taken` holds still here."""
        self._allowed = self.state()["taken"]
        _write(self.folder / "allowed", str(self._allowed))

    def allow(self, steps: int = 1) -> None:
        self._allowed += steps
        _write(self.folder / "allowed", str(self._allowed))

    def open(self) -> None:
        _write(self.folder / "allowed", "open")

    def state(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads((self.folder / "state").read_text())
        except FileNotFoundError:
            return {"taken": 0, "held": False, "admitted": 0}
        return state

    def admitted(self) -> int:
        return int(self.state()["admitted"])

    async def wait_held(self) -> None:
        """Until a step waits at the gate, every allowed step having passed."""
        await self._until(lambda s: s["held"] and s["taken"] == self._allowed, "a held step")

    async def step(self) -> None:
        """Let one step go and wait until the next one is held."""
        self.allow()
        await self.wait_held()

    async def wait_admitted(self, count: int) -> None:
        """Until the daemon has admitted count requests since it started."""
        await self._until(lambda s: s["admitted"] >= count, f"{count} admitted requests")

    async def _until(self, reached: Callable[[dict[str, Any]], bool], what: str) -> None:
        end = time.monotonic() + GATE_TIMEOUT_S
        while not reached(state := self.state()):
            assert time.monotonic() < end, f"the daemon never had {what}: {state}"
            await asyncio.sleep(POLL_S)


# ---------------------------------------------------------------------- the daemon's end


class _DaemonGate:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.taken = 0
        self.held = False
        self.admitted = 0
        self._lock = threading.Lock()  # steps write on the step thread, admissions on the loop

    def _allowed(self) -> int | None:
        """How many steps may have passed while closed; None: open."""
        try:
            text = (self.folder / "allowed").read_text()
        except FileNotFoundError:
            return None
        return None if text == "open" else int(text)

    def _publish(self) -> None:
        with self._lock:
            _write(self.folder / "state", json.dumps(
                {"taken": self.taken, "held": self.held, "admitted": self.admitted}))

    def pass_step(self) -> None:
        """Returns once this step may run (at once while open)."""
        end = time.monotonic() + GATE_TIMEOUT_S
        while (allowed := self._allowed()) is not None and self.taken >= allowed:
            if not self.held:
                self.held = True
                self._publish()
            if time.monotonic() > end:
                raise RuntimeError("the test never let a held step go")
            time.sleep(POLL_S)
        if allowed is not None:
            self.taken += 1
        if self.held or allowed is not None:
            self.held = False
            self._publish()

    def count_admitted(self) -> None:
        self.admitted += 1
        self._publish()


def install(folder: Path) -> None:
    """Put the gate before every engine step and count admissions."""
    from specpage.engine.async_engine import AsyncEngine
    from specpage.engine.engine import Engine

    gate = _DaemonGate(folder)
    step, submit = Engine.step, AsyncEngine.submit

    def gated_step(self: Engine, *args: Any, **options: Any) -> Any:
        gate.pass_step()
        return step(self, *args, **options)

    def counted_submit(self: AsyncEngine, *args: Any, **options: Any) -> Any:
        stream = submit(self, *args, **options)
        gate.count_admitted()
        return stream

    Engine.step = gated_step  # type: ignore[method-assign]
    AsyncEngine.submit = counted_submit  # type: ignore[method-assign]


if __name__ == "__main__":
    install(Path(os.environ[ENV]))
    from specpage.cli import main

    sys.exit(main(sys.argv[1:]))
