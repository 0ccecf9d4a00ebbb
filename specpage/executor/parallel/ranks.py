"""Rank 0's side of the workers on this machine: start them, wait until
each has loaded its shard, and watch them while the engine runs.

A worker that exits before rank 0 asked it to is a fault the engine cannot
recover from (the shards of every layer are gone): the watcher logs one
line naming the rank and its exit status, and tells whoever registered
(`on_fault`): the daemon stops serving and exits.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch.multiprocessing as mp

from specpage.executor.parallel.worker import LOADED, WorkerSpec, spawned
from specpage.models.config import ModelLoadError

log = logging.getLogger("specpage.executor.parallel")
# Seconds a stopped worker has to exit before it is killed.
STOP_GRACE = 5.0
# Environment variable saying how many ranks run on this machine (torchrun's
# name); the others join through env:// from elsewhere.
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"

FaultHandler = Callable[[str], None]


def local_world(world: int) -> int:
    return int(os.environ.get(LOCAL_WORLD_SIZE, world))


def threads_per_rank(world: int, threads: int) -> int:
    """Intra-op threads each local rank may use: its share of the cores,
    and no more than rank 0 had."""
    return max(1, min(threads, (os.cpu_count() or 1) // local_world(world)))


class Workers:
    """The local ranks 1..L-1, running; `close` stops them."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        context = mp.get_context("spawn")
        self.processes: list[BaseProcess] = []
        reports: list[Connection] = []
        for spec in specs:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=spawned, args=(spec, send), daemon=True,
                                      name=f"specpage-rank-{spec.rank}")
            process.start()
            send.close()
            self.processes.append(process)
            reports.append(receive)
        self._closing = False
        self._handlers: list[FaultHandler] = []
        self.fault: str | None = None
        self._lock = threading.Lock()
        # One thread at a time reaps a worker: the watcher and a failed
        # collective's step thread may both find it dead, and the second of
        # two concurrent waits on a child reads no exit status.
        self._reap = threading.Lock()
        self._wake_read, self._wake_write = context.Pipe(duplex=False)
        try:
            self._wait_loaded(reports)
        except BaseException:
            self.stop_watching()
            self.join(grace=0.0)
            raise
        self._watcher = threading.Thread(target=self._watch, name="specpage-ranks", daemon=True)
        self._watcher.start()

    def _wait_loaded(self, reports: list[Connection]) -> None:
        """Until every worker has built its shard; a worker that fails to is
        a start-up failure with its message."""
        pending = dict(zip(reports, self.processes, strict=True))
        while pending:
            ready = wait([*pending, *(p.sentinel for p in pending.values())])
            for report in [r for r in pending if r in ready]:
                try:
                    message = report.recv()
                except EOFError:
                    message = f"{pending[report].name} exited while loading"
                if message != LOADED:
                    raise ModelLoadError(f"tensor-parallel {message}")
                del pending[report]
            for report, process in list(pending.items()):
                if process.sentinel in ready and not report.poll():
                    raise ModelLoadError(f"tensor-parallel {process.name} exited while loading "
                                         f"(status {process.exitcode})")

    def on_fault(self, handler: FaultHandler) -> None:
        """Call handler(reason), from the watcher's thread, when a worker
        dies or a collective fails; at once if one already did."""
        with self._lock:
            self._handlers.append(handler)
            fault = self.fault
        if fault is not None:
            handler(fault)

    def failed(self, reason: str) -> None:
        """Record the engine's fault (the first one counts) and tell the handlers."""
        with self._lock:
            if self.fault is not None or self._closing:
                return
            self.fault = reason
            handlers = list(self._handlers)
        log.error("tensor parallelism failed: %s; the engine cannot step", reason)
        for handler in handlers:
            handler(reason)

    def death(self, timeout: float | None = None) -> str | None:
        """The first worker found dead within timeout seconds (None: until
        one is), said in words; None if none is."""
        sentinels = {p.sentinel: p for p in self.processes}
        for sentinel in wait(list(sentinels), timeout):
            process = sentinels[sentinel]  # type: ignore[index]
            with self._reap:
                process.join()
            return f"{process.name} (pid {process.pid}) exited with status {process.exitcode}"
        return None

    def _watch(self) -> None:
        wait([self._wake_read, *(p.sentinel for p in self.processes)])
        reason = self.death(timeout=0)
        if reason is not None:
            self.failed(reason)

    def stop_watching(self) -> None:
        """Before the workers are told to stop: their exits are no fault."""
        with self._lock:
            self._closing = True
        self._wake_write.send(None)

    def join(self, grace: float = STOP_GRACE) -> None:
        """Wait for the workers to exit (told to stop), killing what is left
        after grace seconds."""
        for process in self.processes:
            with self._reap:
                process.join(grace)
                if process.is_alive():
                    process.kill()
                    process.join()
