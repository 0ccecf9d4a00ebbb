"""The asyncio bridge: one thread owns the engine and steps it while there is
work, so the event loop keeps serving while the models compute, and streams
one step's tokens while the next step runs.

Submissions and aborts are queued and reach the engine at the next step
boundary. Each request has a stream whose pending tokens are merged per
sample, so a slow reader never stalls the step and never holds more than
one pending chunk per sample.

A front end hands over a prompt, its sampling parameters and its options
(`add_request`); templating and tokenizing run on a pool of threads owned
here, then the request is admitted on the event loop.

Admission is counted here, on the event loop, not from the engine's last
stats: a request holds running places (one per sample) from the moment it
is admitted until its samples end, whether the engine has taken it yet or
a step in flight is taking it now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from specpage.core.outputs import Top
from specpage.core.request import (
    Request,
    SamplingParams,
    Timings,
    TokenLogprobs,
    Usage,
    ValidationError,
)
from specpage.engine import Engine, EngineStats, RequestOutput
from specpage.engine.submission import Preparer, Prompt, RequestOptions

log = logging.getLogger("specpage.engine")
# Requests tokenized at once, off the event loop, by threads of their own. Fast
# tokenizers release the GIL while they encode, so each one takes a core from
# the engine's step thread. A pool this size bounds them however calls end: a
# cancelled call cannot stop the thread tokenizing its prompt, only free its
# place in a queue, so a semaphore around shared threads would let a client that
# cancels at once keep any number of them busy. Every front end shares it.
PREPARE_CONCURRENCY = 2
PREPARE_THREAD_NAME = "specpage-prepare"
STEP_THREAD_NAME = "specpage-step"
# Steps the step thread may run ahead of the event loop's delivery of their
# outputs: 1 would make every step wait for the last one's tokens to be
# handed to their streams; a bound keeps a starved loop from queueing
# outputs without end.
UNDELIVERED_STEPS = 2
THREAD_POLL_S = 0.1  # how often the step thread, blocked, checks for stop


def step_thread() -> ThreadPoolExecutor:
    """The one thread that runs torch for an AsyncEngine: build the engine on
    it (`loop.run_in_executor(thread, ...)`), then hand it to AsyncEngine.

    libgomp (torch's OpenMP) keeps a team of worker threads per thread that
    ever ran a parallel op, and once it manages more threads than there are
    cores it stops letting idle workers spin: every op then waits for its
    workers to wake. Loading the models on one thread and stepping on
    another made a batch-1 decode step about 1.5x slower on 2 cores."""
    return ThreadPoolExecutor(1, thread_name_prefix=STEP_THREAD_NAME)


class QueueFullError(Exception):
    """The admission queue is at its bound; retry later."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(f"admission queue full; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class DrainingError(Exception):
    """The engine no longer admits requests (shutting down)."""


class EngineFaultError(Exception):
    """The engine failed while this request was in flight."""


@dataclass
class Chunk:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    top_logprobs: list[Top] = field(default_factory=list)  # per token, when asked for
    # the prompt's, with the sample's first chunk when asked for (None at position 0)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class Final:
    usage: Usage
    timings: Timings
    finish_reasons: list[str]  # every sample's, by index

    @property
    def finish_reason(self) -> str:
        """Sample 0's."""
        return self.finish_reasons[0]


class RequestStream:
    """What one request has produced and its reader has not yet taken."""

    def __init__(self, request_id: str, num_samples: int = 1,
                 prompt_token_ids: tuple[int, ...] = ()) -> None:
        self.request_id = request_id
        self.num_samples = num_samples
        self.prompt_token_ids = prompt_token_ids  # as the engine runs it (echo needs it)
        self._pending: dict[int, Chunk] = {}  # per sample, merged
        self._finish_reasons: dict[int, str] = {}  # per sample, once it ended
        self._final: Final | None = None
        self._error: BaseException | None = None
        self._wake = asyncio.Event()

    @property
    def num_places(self) -> int:
        """Running places the request holds or will hold: one per sample
        that has not ended (a first sample forks into n, see the scheduler)."""
        return self.num_samples - len(self._finish_reasons)

    def push(self, out: RequestOutput) -> None:
        chunk = self._pending.setdefault(out.index, Chunk(out.index))
        chunk.token_ids += out.token_ids
        chunk.text += out.text
        chunk.num_tokens = out.num_tokens
        chunk.logprobs += out.logprobs or []
        chunk.top_logprobs += out.top_logprobs or []
        if out.prompt_logprobs is not None:
            chunk.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            chunk.finish_reason = out.finish_reason
            self._finish_reasons[out.index] = out.finish_reason or ""
        if out.usage is not None and out.timings is not None:
            reasons = [self._finish_reasons.get(i, "") for i in range(self.num_samples)]
            self._final = Final(out.usage, out.timings, reasons)
        self._wake.set()

    @property
    def aborted(self) -> bool:
        """Whether an abort cut any of its samples."""
        return "abort" in self._finish_reasons.values()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake.set()

    async def events(self) -> AsyncIterator[Chunk | Final]:
        while True:
            await self._wake.wait()
            self._wake.clear()
            # More may arrive while a chunk is being sent: drain until none
            # is pending, so the final event never overtakes a chunk.
            while self._pending:
                chunks, self._pending = list(self._pending.values()), {}
                for chunk in chunks:
                    yield chunk
            if self._error is not None:
                raise self._error
            if self._final is not None:
                yield self._final
                return


class AsyncEngine:
    """All that the front ends use of the engine.

    max_prompt_tokens bounds a prompt (token ids counted before anything
    else, text by its bytes before tokenizing); None: the model's context."""

    def __init__(self, engine: Engine, max_queue: int = 256,
                 max_prompt_tokens: int | None = None,
                 thread: ThreadPoolExecutor | None = None) -> None:
        """thread: from step_thread(), the one the engine was built on; its
        owner shuts it down. None: a thread of its own, shut down by stop()."""
        self.engine = engine
        self.max_queue = max_queue
        self.streams: dict[str, RequestStream] = {}
        self._submissions: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._work = threading.Event()  # wakes the step thread
        self._undelivered = threading.BoundedSemaphore(UNDELIVERED_STEPS)
        self._closing = False  # the step thread ends
        self._own_thread = thread is None
        self._thread = step_thread() if thread is None else thread
        self._running: asyncio.Future[None] | None = None  # the step thread's loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._preparer = Preparer(
            engine, engine.max_context if max_prompt_tokens is None else max_prompt_tokens)
        self._preparing = ThreadPoolExecutor(PREPARE_CONCURRENCY,
                                             thread_name_prefix=PREPARE_THREAD_NAME)
        self._stats = engine.stats()
        self.draining = False
        self._stopping = False  # stop() aborts what is left: those requests did not end OK
        # called after every step with its outputs and the engine's stats (metrics)
        self.step_observers: list[Callable[[list[RequestOutput], EngineStats], None]] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the step thread; outputs are delivered on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._running = self._loop.run_in_executor(self._thread, self._run_steps)
        self._running.add_done_callback(self._steps_ended)

    def _steps_ended(self, running: asyncio.Future[None]) -> None:
        """The step thread's loop ended: by stop(), or by a bug outside the
        engine's own fault handling, which must not leave streams hanging."""
        error = None if running.cancelled() else running.exception()
        if error is None:
            return
        log.error("the step thread failed; the engine stops admitting requests",
                  exc_info=error)
        self.draining = True
        for stream in self.streams.values():
            stream.fail(EngineFaultError(f"engine fault: {error}"))
        self.streams.clear()

    async def stop(self, timeout: float = 10.0) -> None:
        """Drop the prompts queued for tokenizing, abort whatever is left,
        wait for it to end (at most timeout seconds), fail any stream still
        open, and stop the engine task.
        A request cut by it ends its stream with DrainingError after the
        chunks it produced, never as a complete output."""
        self._stopping = True
        # The prompts still queued for tokenizing: their calls fail as drained.
        self._preparing.shutdown(wait=False, cancel_futures=True)
        for request_id in list(self.streams):
            self.abort(request_id)
        end = asyncio.get_running_loop().time() + timeout
        running = self._running
        while self.streams and running is not None and not running.done():
            if asyncio.get_running_loop().time() > end:
                break
            await asyncio.sleep(0.01)
        for stream in self.streams.values():
            stream.fail(DrainingError("the server stopped"))
        self.streams.clear()
        self._closing = True
        self._work.set()
        if running is not None:
            with contextlib.suppress(Exception):  # logged by _steps_ended
                await running  # the step in flight ends first
        if self._own_thread:
            self._thread.shutdown(wait=False)

    # ------------------------------------------------------------------ requests

    @property
    def num_queued(self) -> int:
        """Running places that admitted requests wait for (a request of n
        samples needs n; see `_queued_with`)."""
        return self._queued_with(0)

    def _queued_with(self, num_places: int) -> int:
        """Places admitted requests, and num_places more, would wait for.

        Counted from the streams, so a request holds its places from the
        moment it is admitted, also while a step in flight takes it from
        the submissions (the engine's stats see it only once that step is
        over). A submission the engine will start at its next step, a
        running place being free, is not queued. While the engine's last
        step left sequences waiting (short of blocks, say), it starts no
        new submission either: each of those waits too."""
        held = sum(stream.num_places for stream in self.streams.values()) + num_places
        beyond_running = held - self.engine.config.max_num_seqs
        waiting = self._stats.waiting
        pending = sum(request.params.n for request in self._submissions)
        behind_waiting = waiting + pending + num_places if waiting else 0
        return max(0, beyond_running, behind_waiting)

    async def add_request(self, prompt: Prompt, params: SamplingParams,
                          options: RequestOptions) -> RequestStream:
        """Prepare the request on the prepare pool and admit it.

        Tokenizing and templating take seconds for megabytes of text: the
        event loop must keep answering health checks and streams meanwhile,
        and the step thread keeps stepping. A call cancelled while its prompt
        waits for a thread drops it from the queue; one already tokenizing
        runs to its end on its thread."""
        self._check_open()
        try:
            made = await asyncio.get_running_loop().run_in_executor(
                self._preparing, self._preparer.make_request, prompt, params, options)
        except asyncio.CancelledError:
            # stop() dropped the prompt from the queue: the call itself was not cancelled
            task = asyncio.current_task()
            if self._stopping and task is not None and not task.cancelling():
                raise DrainingError("the server stopped") from None
            raise
        return self.submit(made)

    def _check_open(self) -> None:
        if self.draining or self._stopping:
            raise DrainingError("the server is draining")

    def submit(self, request: Request) -> RequestStream:
        """Admit a request already made (see `add_request`)."""
        self._check_open()
        if self._queued_with(request.params.n) > self.max_queue:
            raise QueueFullError(self._retry_after_ms())
        if request.request_id in self.streams:
            raise ValidationError("request_id", f"{request.request_id!r} is already running")
        stream = RequestStream(request.request_id, request.params.n, request.prompt_token_ids)
        self.streams[request.request_id] = stream
        self._submissions.append(request)
        self._work.set()
        return stream

    def abort(self, request_id: str) -> bool:
        if request_id not in self.streams:
            return False
        self._aborts.append(request_id)
        self._work.set()
        return True

    def abort_stream(self, stream: RequestStream) -> bool:
        """Abort the stream's request unless it has ended: its id may already
        belong to another request."""
        if self.streams.get(stream.request_id) is not stream:
            return False
        return self.abort(stream.request_id)

    # What the front ends read of the engine.
    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def k_max(self) -> int:
        return self.engine.k_max

    def stats(self) -> EngineStats:
        return self._stats

    def _retry_after_ms(self) -> int:
        # Roughly the time for the queue ahead to start: a few steps per request.
        return max(100, min(10_000, 50 * self.num_queued // max(1, self._stats.running)))

    # ------------------------------------------------------------------ the loop

    def _run_steps(self) -> None:
        """The step thread: steps while there is work, handing each step's
        outputs to the event loop without waiting for them to be delivered,
        so the next step's forward runs while the loop streams the last
        step's tokens. At most UNDELIVERED_STEPS steps wait for the loop."""
        while not self._closing:
            if not (self._submissions or self._aborts or self.engine.has_unfinished()):
                self._work.wait()
                self._work.clear()
                continue
            if not self._undelivered.acquire(timeout=THREAD_POLL_S):
                continue
            try:
                outputs, stats = self._step()
            except Exception as error:  # noqa: BLE001 (an engine fault must not stop serving)
                self._undelivered.release()
                self._fault(error)
            else:
                self._post(self._delivered, outputs, stats)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        """Run callback on the event loop (nothing, once the loop is closed)."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(callback, *args)

    def _delivered(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._undelivered.release()
        self._deliver(outputs, None)
        self._observe(outputs, stats)

    def _observe(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._stats = stats
        for observer in self.step_observers:
            observer(outputs, stats)

    def _fault(self, error: Exception) -> None:
        """On the step thread: fail what was in flight, then wait until the
        event loop has failed the streams the engine no longer knows, before
        another step can take a submission whose stream is gone."""
        log.error("engine step failed; failing the requests in flight", exc_info=error)
        fault = EngineFaultError(f"engine fault: {error}")
        try:
            outputs, stats = self._recover()
        except Exception:  # noqa: BLE001
            log.exception("recovery failed; the engine stops admitting requests")
            self.draining = True
            outputs, stats = [], self._stats
        handled: Future[None] = Future()
        self._post(self._faulted, outputs, stats, fault, set(self.engine.requests), handled)
        while not self._closing:
            with contextlib.suppress(FutureTimeout):
                handled.result(timeout=THREAD_POLL_S)
                return

    def _faulted(self, outputs: list[RequestOutput], stats: EngineStats,
                 fault: EngineFaultError, known: set[str], handled: Future[None]) -> None:
        try:
            self._deliver(outputs, fault)
            # Streams whose request the engine no longer knows (lost mid-step,
            # or never submitted) end with the fault rather than never; a
            # submission left behind by a failed submit goes with its
            # stream, or it would run with no reader and block a retry.
            for request_id in [r for r in self.streams if r not in known]:
                self.streams.pop(request_id).fail(fault)
            self._submissions = deque(
                r for r in self._submissions if r.request_id in self.streams)
            self._observe(outputs, stats)
        finally:
            handled.set_result(None)

    def _step(self) -> tuple[list[RequestOutput], EngineStats]:
        # Runs on the step thread: the engine is only ever touched there.
        while self._submissions:
            self.engine.submit(self._submissions.popleft())
        while self._aborts:
            self.engine.abort(self._aborts.popleft())
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        return outputs, self.engine.stats()

    def _recover(self) -> tuple[list[RequestOutput], EngineStats]:
        return self.engine.fail_all(), self.engine.stats()

    def _deliver(self, outputs: list[RequestOutput], error: BaseException | None) -> None:
        """Push outputs to their streams; with an error (an engine fault),
        a stream whose request ended fails after its samples' last chunks."""
        ended = set()
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            stream.push(out)
            if out.usage is not None:
                ended.add(out.request_id)
        for request_id in ended:
            stream = self.streams.pop(request_id)
            if error is not None:
                stream.fail(error)
            elif self._stopping and stream.aborted:
                stream.fail(DrainingError(
                    f"the server stopped before request {request_id} finished"))
