"""What every front end (gRPC, OpenAI-compatible HTTP) shares between its wire
format and the engine: the engine once it is loaded, request-id checks, and the
count of calls in flight until their streams end.

A front end turns its message into a prompt, sampling parameters and
`RequestOptions` and hands them to `AsyncEngine.add_request`, which prepares
the request off the event loop; it maps the errors: `ValidationError` (naming
the field, in the front end's words), `LoadingError`, `DrainingError` and
`QueueFullError` (with `retry_after_ms`). Tokenizing that is not a request's
(the HTTP front's /tokenize and /detokenize) runs on threads of its own here
(`off_loop`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from specpage.core.request import ValidationError
from specpage.engine.async_engine import (
    PREPARE_CONCURRENCY,
    AsyncEngine,
    Chunk,
    DrainingError,
    Final,
    RequestStream,
)

T = TypeVar("T")

# Request ids are echoed as gRPC metadata and HTTP headers, whose values must be
# printable ASCII; 128 characters hold a UUID or a W3C trace id with room to spare.
MAX_REQUEST_ID_LENGTH = 128


class LoadingError(Exception):
    """The models are still loading; nothing is admitted yet."""


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise ValidationError("request_id", f"{len(request_id)} characters exceed the limit "
                              f"of {MAX_REQUEST_ID_LENGTH}")
    bad = next((c for c in request_id if not " " <= c <= "~"), None)
    if bad is not None:
        raise ValidationError("request_id", f"character U+{ord(bad):04X} is not printable "
                              "ASCII (0x20-0x7E)")


class Frontend:
    """Shared by the front ends of one daemon: one engine, one in-flight count."""

    def __init__(self, on_first_token: Callable[[float], None] = lambda s: None) -> None:
        self._engine: AsyncEngine | None = None
        self.on_first_token = on_first_token
        self.in_flight = 0
        # As many as the engine's prepare threads, for the same reason: a
        # cancelled call cannot stop its thread, so only a pool bounds them.
        self._tokenizing = ThreadPoolExecutor(PREPARE_CONCURRENCY,
                                              thread_name_prefix="specpage-tokenize")

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine

    @property
    def ready(self) -> bool:
        return self._engine is not None

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise LoadingError("the models are loading")
        return self._engine

    def check_open(self) -> None:
        """LoadingError or DrainingError unless requests are admitted now."""
        if self.engine.draining:
            raise DrainingError("the server is draining")

    @contextlib.asynccontextmanager
    async def running(self, stream: RequestStream) -> AsyncIterator[None]:
        """Counts the call in flight (the drain waits for it); however the call
        ends, a request it leaves unfinished is aborted and its blocks freed at
        the engine's next step."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.engine.abort_stream(stream)
            self.in_flight -= 1

    async def events(self, stream: RequestStream,
                     arrival: float) -> AsyncIterator[Chunk | Final]:
        """The stream's events; the first chunk with tokens times the first
        token, for every front end alike."""
        first = True
        async for event in stream.events():
            if first and isinstance(event, Chunk) and event.token_ids:
                self.on_first_token(time.monotonic() - arrival)
                first = False
            yield event

    async def off_loop(self, work: Callable[[], T]) -> T:
        """work's result, computed on the tokenize threads."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work)

    def close(self) -> None:
        """Drop the work queued for the tokenize threads (the daemon stops)."""
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    async def wait_idle(self, grace: float) -> bool:
        """Wait until no call is in flight, at most grace seconds."""
        end = time.monotonic() + grace
        while self.in_flight and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return self.in_flight == 0


# The finish reasons that mean a request was cut rather than completed, the
# worst first: a fault beats a deadline. An abort is what its caller asked for.
CUT_SHORT_REASONS = ("error", "timeout")


def cut_short(finish_reasons: Sequence[str]) -> str | None:
    """The worst reason a sample was cut short for, or None if all completed."""
    return next((r for r in CUT_SHORT_REASONS if r in finish_reasons), None)
