"""What an HTTP stream sends before the engine's first output: nothing but the
response's headers. The routes run as uvicorn would run them, over an engine
stand-in whose one stream gets an output only when the test pushes it, so the
order is the engine's own, never the clock's: a client timing its first SSE
event times the first token (TTFT), not the prompt's arrival."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.types import ASGIApp, Message

from specpage.core.request import SamplingParams, Timings, Usage
from specpage.engine import RequestOutput
from specpage.engine.async_engine import Chunk, EngineFaultError, Final, RequestStream
from specpage.engine.submission import Prompt, RequestOptions
from specpage.serve.frontend import Frontend
from specpage.serve.openai_api.app import build_app
from specpage.serve.openai_api.served import Served

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 8}
COMPLETION = {"prompt": [5, 6, 7], "stream": True, "max_tokens": 8}


class WatchedStream(RequestStream):
    """A request's stream that tells when its reader first waits on it."""

    def __init__(self, request_id: str, num_samples: int) -> None:
        super().__init__(request_id, num_samples)
        self.reading = asyncio.Event()

    async def events(self) -> AsyncIterator[Chunk | Final]:
        self.reading.set()
        async for event in super().events():
            yield event


class HeldEngine:
    """What the routes use of AsyncEngine, for one request whose outputs come
    only from the test."""

    draining = False
    tokenizer = None
    max_context = 64

    def __init__(self) -> None:
        self.stream: WatchedStream | None = None
        self.admitted = asyncio.Event()

    async def add_request(self, prompt: Prompt, params: SamplingParams,
                          options: RequestOptions) -> RequestStream:
        self.stream = WatchedStream(options.request_id, params.n)
        self.admitted.set()
        return self.stream

    def abort_stream(self, stream: RequestStream) -> bool:
        return False

    async def reading(self) -> WatchedStream:
        """The stream, once the response's body waits for its first output."""
        await self.admitted.wait()
        assert self.stream is not None
        await self.stream.reading.wait()
        return self.stream


class Exchange:
    """One POST to the app as an ASGI server hands it over; the client stays."""

    def __init__(self, app: ASGIApp, path: str, body: dict[str, Any]) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80),
                 "headers": [(b"content-type", b"application/json"),
                             (b"x-request-id", b"r1")]}
        self.sent: list[Message] = []
        self._body = json.dumps(body).encode()
        self._read = False
        self._more = asyncio.Event()
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> Message:
        if not self._read:
            self._read = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect: the client reads on
        raise AssertionError("unreachable")

    async def _send(self, message: Message) -> None:
        self.sent.append(message)
        self._more.set()

    def events(self) -> list[Any]:
        """The SSE events sent so far, JSON decoded ("[DONE]" as it is)."""
        text = b"".join(m.get("body", b"") for m in self.sent
                        if m["type"] == "http.response.body").decode()
        assert text.endswith("\n\n") or text == ""
        found = []
        for event in text.split("\n\n")[:-1]:
            data = event.removeprefix("data: ")
            found.append(data if data == "[DONE]" else json.loads(data))
        return found

    async def next_events(self, count: int) -> list[Any]:
        """Until count events have been sent, for as long as the app is not done."""
        while len(self.events()) < count and not self.task.done():
            self._more.clear()
            waiter = asyncio.ensure_future(self._more.wait())
            await asyncio.wait((waiter, self.task), return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        return self.events()


def output(index: int, tokens: list[int], text: str, total: int,
           finished: bool = False, last: bool = False) -> RequestOutput:
    return RequestOutput("r1", index, tokens, text, total, finished=finished,
                         finish_reason="length" if finished else None,
                         usage=Usage(prompt_tokens=3, completion_tokens=total) if last else None,
                         timings=Timings() if last else None)


async def open_stream(body: dict[str, Any], path: str) -> tuple[Exchange, WatchedStream]:
    engine = HeldEngine()
    frontend = Frontend()
    frontend.attach(engine)  # type: ignore[arg-type]
    exchange = Exchange(build_app(frontend, Served(("m",), "m", None, 64), None, None), path, body)
    stream = await engine.reading()
    return exchange, stream


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT),
                                            ("/v1/completions", COMPLETION)],
                         ids=["chat", "completions"])
async def test_no_sse_event_goes_before_the_engines_first_output(
        path: str, body: dict[str, Any]) -> None:
    exchange, stream = await open_stream(body, path)
    # The body waits for the engine: the headers are out, no event is.
    [start] = exchange.sent
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert exchange.events() == []
    stream.push(output(0, [17], "Hi", 1))
    [first] = await exchange.next_events(1)
    if path == "/v1/chat/completions":
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    else:
        assert first["choices"][0]["text"] == "Hi"
    stream.push(output(0, [18], " there", 2, finished=True, last=True))
    events = await exchange.next_events(3)
    assert events[-1] == "[DONE]" and len(events) == 3
    await exchange.task


@pytest.mark.asyncio
async def test_a_first_token_without_text_still_opens_with_the_role() -> None:
    """Each choice's first chunk carries the role, with "" while its token
    has no text yet (part of a character); later chunks never do."""
    exchange, stream = await open_stream({**CHAT, "n": 2}, "/v1/chat/completions")
    stream.push(output(0, [17], "", 1))
    stream.push(output(1, [19], "Yo", 1))
    await exchange.next_events(2)
    stream.push(output(0, [18], "é", 2, finished=True))
    stream.push(output(1, [20], "", 2, finished=True, last=True))
    events = await exchange.next_events(5)
    assert events[-1] == "[DONE]"
    deltas = [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in events[:-1]]
    assert deltas == [(0, {"role": "assistant", "content": ""}),
                      (1, {"role": "assistant", "content": "Yo"}),
                      (0, {"content": "é"}), (1, {})]
    await exchange.task


@pytest.mark.asyncio
async def test_a_fault_before_the_first_token_is_the_only_event() -> None:
    """No role chunk goes ahead of the error: the stream is its error event
    alone, without [DONE]."""
    exchange, stream = await open_stream(CHAT, "/v1/chat/completions")
    stream.fail(EngineFaultError("engine fault: injected"))
    await exchange.task
    assert exchange.events() == [{"error": {"message": "engine fault: injected",
                                            "type": "server_error", "param": None,
                                            "code": "engine_fault"}}]
