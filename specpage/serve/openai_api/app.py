"""The OpenAI-compatible routes, on the same `Frontend` (request ids, in-flight
count) and `AsyncEngine` (preparing, validation, admission) as the gRPC service.

A streamed response is Server-Sent Events: `data: {json}` per chunk and
`data: [DONE]` last. Its status is decided before the first byte, so every
refusal (400, 404, 429, 503) is a plain error response. A stream cut after it
began (an engine fault, or the daemon stopping past its drain grace) sends one
`data: {"error": {...}}` event and closes without `[DONE]`, as vLLM does; the
`openai` SDK raises it as an `APIError`. A client that disconnects aborts its
request, streamed or not; the engine frees its blocks at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from specpage.core.grammar import Constraint
from specpage.core.request import SamplingParams, Usage, ValidationError
from specpage.engine.async_engine import (
    Chunk,
    DrainingError,
    EngineFaultError,
    Final,
    RequestStream,
)
from specpage.engine.submission import ChatPrompt, Prompt, RequestOptions, TextPrompt
from specpage.serve.frontend import Frontend, LoadingError, check_request_id, cut_short
from specpage.serve.metrics import Metrics
from specpage.serve.openai_api import protocol, tools
from specpage.serve.openai_api.errors import APIError, ErrorBody, api_error, invalid
from specpage.serve.openai_api.fields import IGNORED_HEADER, IgnoredFields
from specpage.serve.openai_api.render import ChoicePrompt, Renderer, Sample, total
from specpage.serve.openai_api.served import Served
from specpage.serve.openai_api.tokenize import TokenizeRoutes
from specpage.serve.openai_api.tools import ToolPlan, ToolStream

T = TypeVar("T")
# Paths a load balancer probes without credentials, as gRPC health is open.
OPEN_PATHS = frozenset({"/health"})
# nginx's status for a client that went away before its response: logged, never seen.
CLIENT_CLOSED_REQUEST = 499
# What a request cut short (see frontend.cut_short) was cut by.
CUT_SHORT = {"error": "the engine failed while generating", "timeout": "the request timed out"}


@dataclass(frozen=True)
class Call:
    """One completion request, decoded and checked, before it is admitted."""

    body: protocol.ChatCompletionRequest | protocol.CompletionRequest
    prompts: list[protocol.PromptPart]
    max_tokens: int | None  # None: as many as the context leaves
    arrival: float
    model: str  # the name the response carries
    renamed: dict[str, str]  # the engine's field names -> the client's
    ignored: list[str]  # fields accepted unread (fields.py)
    tools: ToolPlan | None = None  # a chat's tools (tools.py)


class OpenAIRoutes:
    def __init__(self, frontend: Frontend, served: Served, metrics: Metrics | None) -> None:
        self.frontend = frontend
        self.served = served
        self.metrics = metrics
        self.ignored = IgnoredFields()

    # ------------------------------------------------------------------ endpoints

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body, ignored = protocol.decode(await self._body(request),
                                        protocol.ChatCompletionRequest)
        model = self.served.model(body.model)
        ignored += protocol.check_supported(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None and (
                body.max_tokens != body.max_completion_tokens):
            raise invalid("max_completion_tokens", "max_completion_tokens and max_tokens "
                          "differ; give one")
        max_tokens = (body.max_tokens if body.max_completion_tokens is None
                      else body.max_completion_tokens)  # None: as many as the context leaves
        tokenizer = self.frontend.engine.tokenizer
        messages = protocol.chat_messages(body.messages)
        tool_plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer)
        if body.tools and tool_plan is None:  # never to be called: changes nothing
            ignored += [name for name in ("tools", "tool_choice") if getattr(body, name)]
        tools.check_messages(messages, tokenizer)
        options = body.template_options
        if tool_plan is not None:
            options = dataclasses.replace(options, tools=tool_plan.tools)
        prompt = ChatPrompt(tools.tool_messages(messages), options)
        renamed = {"max_tokens": "max_completion_tokens"
                   if body.max_completion_tokens is not None else "max_tokens"}
        return await self._serve(request, Call(
            body, [protocol.PromptPart("messages", prompt)], max_tokens, arrival, model,
            renamed, ignored, tool_plan))

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body, ignored = protocol.decode(await self._body(request), protocol.CompletionRequest)
        model = self.served.model(body.model)
        ignored += protocol.check_supported(body)
        # OpenAI's default for completions is 16 tokens, the engine's too.
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and body.echo:
            # the prompt alone (lm-eval's loglikelihoods): the engine samples
            # one token, which the response leaves out (Renderer.echo_only)
            max_tokens = 1
        return await self._serve(request, Call(
            body, protocol.completion_prompts(body.prompt), max_tokens, arrival, model, {},
            ignored))

    async def models(self, request: Request) -> Response:
        max_context = self.frontend.engine.max_context if self.frontend.ready else None
        cards = [self.served.card(name, max_context) for name in self.served.names]
        return _json({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        max_context = self.frontend.engine.max_context if self.frontend.ready else None
        name = self.served.model(request.path_params["name"] or None)
        return _json(self.served.card(name, max_context))

    async def health(self, request: Request) -> Response:
        try:
            self.frontend.check_open()
        except (LoadingError, DrainingError) as error:
            return api_error(error).response()
        return Response(b"", 200)

    async def metrics_text(self, request: Request) -> Response:
        assert self.metrics is not None
        return Response(self.metrics.render(), 200, media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ one request

    async def _serve(self, request: Request, call: Call) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        renamed = {"request_id": "X-Request-Id", **call.renamed}
        body = call.body
        try:
            check_request_id(request_id)
            params = protocol.sampling_params(body, call.max_tokens)
            streams = await self._admit(call, request_id, params,
                                        _constraint(call, self.frontend.engine.tokenizer))
        except Exception as error:  # noqa: BLE001 (api_error re-raises what it cannot map)
            raise api_error(error, renamed) from None
        tokenizer = self.frontend.engine.tokenizer
        completion = isinstance(body, protocol.CompletionRequest)
        renderer = Renderer(
            chat=not completion, request_id=request_id,
            model=call.model, logprobs=params.logprobs,
            token_text=(lambda t: tokenizer.decode([t])) if tokenizer is not None
            else (lambda t: f"token_id:{t}"),
            top_logprobs=params.top_logprobs,
            echo=completion and body.echo,  # type: ignore[union-attr]
            echo_only=completion and body.echo and body.max_tokens == 0,  # type: ignore[union-attr]
            prompt_logprobs=body.prompt_logprobs,
            tools=call.tools is not None and call.tools.parses)
        prompts = [ChoicePrompt(stream.prompt_token_ids,
                                _echo_text(part.prompt, stream, tokenizer))
                   for part, stream in zip(call.prompts, streams, strict=True)]
        headers = {"X-Request-Id": request_id}
        if call.ignored:
            headers[IGNORED_HEADER] = ", ".join(self.ignored.note(call.ignored))
        if body.stream:
            include_usage = (body.stream_options is not None
                             and body.stream_options.include_usage)
            return StreamingResponse(
                self._events(streams, renderer, call.arrival, include_usage, prompts),
                headers=headers, media_type="text/event-stream")
        async with self._running(streams):
            samples = [Sample(prompt) for prompt in prompts for _ in range(params.n)]
            final = await _unless_disconnected(
                request, self._collect(streams, samples, call.arrival))
        if final is None:  # nobody is there to read a response
            return Response(b"", CLIENT_CLOSED_REQUEST)
        if renderer.echo_only:
            final = _nothing_generated(final)
        return _json(renderer.response(samples, final), headers)

    async def _admit(self, call: Call, request_id: str, params: SamplingParams,
                     constraint: Constraint | None = None) -> list[RequestStream]:
        """Every prompt admitted as a request of its own (each counts against
        the admission bound), or none: a prompt refused, or the client gone,
        aborts those already admitted."""
        engine, batch = self.frontend.engine, len(call.prompts) > 1
        # More places than the queue holds: a retry would find no more room.
        if batch and len(call.prompts) * params.n > engine.max_queue:
            raise ValidationError("prompt", f"{len(call.prompts)} prompts x n = {params.n} "
                                  f"exceed the admission bound of {engine.max_queue} samples")
        field = "messages" if isinstance(call.body, protocol.ChatCompletionRequest) else "prompt"
        options = [RequestOptions(
            f"{request_id}-{i}" if batch else request_id, call.arrival,
            priority=call.body.priority, cache_salt=call.body.cache_salt or "",
            cache_text=not call.body.no_suffix_cache, constraint=constraint,
            max_tokens_to_context=call.max_tokens is None, prompt_field=part.field,
            chat_field=field) for i, part in enumerate(call.prompts)]
        for option in options:
            check_request_id(option.request_id)
        tasks = [asyncio.ensure_future(engine.add_request(part.prompt, params, option))
                 for part, option in zip(call.prompts, options, strict=True)]
        try:
            await asyncio.wait(tasks)
        except BaseException:  # the client went away: none of them runs
            for task in tasks:
                task.cancel()
            self._abort_admitted(tasks)
            raise
        refused = [task.exception() for task in tasks if task.exception() is not None]
        if refused:
            self._abort_admitted(tasks)
            raise refused[0]  # type: ignore[misc]
        return [task.result() for task in tasks]

    def _abort_admitted(self, tasks: Sequence[asyncio.Future[RequestStream]]) -> None:
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                self.frontend.engine.abort_stream(task.result())

    @contextlib.asynccontextmanager
    async def _running(self, streams: list[RequestStream]) -> AsyncIterator[None]:
        """Each stream counted in flight until the call ends (Frontend.running)."""
        async with contextlib.AsyncExitStack() as stack:
            for stream in streams:
                await stack.enter_async_context(self.frontend.running(stream))
            yield

    async def _merged(self, streams: list[RequestStream],
                      arrival: float) -> AsyncGenerator[tuple[int, Chunk | Final]]:
        """Every stream's events as they come, each with its stream's place in
        the batch, until the last stream's Final; a stream's error is raised."""
        if len(streams) == 1:
            async for event in self.frontend.events(streams[0], arrival):
                yield 0, event
            return
        # One place per stream: a stream merges what its reader has not taken.
        queue: asyncio.Queue[tuple[int, Chunk | Final | Exception]] = asyncio.Queue(
            len(streams))

        async def pump(place: int, stream: RequestStream) -> None:
            try:
                async for event in self.frontend.events(stream, arrival):
                    await queue.put((place, event))
            except Exception as error:  # noqa: BLE001 (raised where the events are read)
                await queue.put((place, error))

        pumps = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
        try:
            ended = 0
            while ended < len(streams):
                place, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                ended += isinstance(item, Final)
                yield place, item
        finally:
            for task in pumps:
                task.cancel()

    async def _collect(self, streams: list[RequestStream], samples: list[Sample],
                       arrival: float) -> Usage:
        """Every sample's output into samples (prompt i's sample j at i x n + j);
        the usage of all."""
        n = len(samples) // len(streams)
        finals: list[Usage] = []
        try:
            async with contextlib.aclosing(self._merged(streams, arrival)) as events:
                async for place, event in events:
                    if isinstance(event, Chunk):
                        samples[place * n + event.index].add(event)
                    else:
                        _check_complete(event.finish_reasons)
                        finals.append(event.usage)
        except (EngineFaultError, DrainingError) as error:
            raise api_error(error) from None
        return total(finals)

    async def _events(self, streams: list[RequestStream], renderer: Renderer, arrival: float,
                      include_usage: bool,
                      prompts: list[ChoicePrompt]) -> AsyncIterator[bytes]:
        # Runs as the response's body; a client that disconnects cancels it here.
        # Nothing is sent before the engine's first output: a chat choice's
        # role goes with its first chunk (see Renderer.chunk).
        opened: set[int] = set()  # the choices whose first chunk is sent
        n = streams[0].num_samples
        # per choice, its calls split out as they close (tools.py)
        calls = {i: ToolStream() for i in range(n * len(streams))} if renderer.tools else {}
        finals: list[Usage] = []
        async with self._running(streams):
            try:
                async with contextlib.aclosing(self._merged(streams, arrival)) as events:
                    async for place, event in events:
                        if isinstance(event, Chunk):
                            index = place * n + event.index
                            yield _event(renderer.chunk(event, index, opens=index not in opened,
                                                        prompt=prompts[place],
                                                        tool_stream=calls.get(index)))
                            opened.add(index)
                            continue
                        _check_complete(event.finish_reasons)
                        finals.append(event.usage)
                if include_usage:
                    counts = total(finals)
                    yield _event(renderer.usage_chunk(
                        _nothing_generated(counts) if renderer.echo_only else counts))
                yield b"data: [DONE]\n\n"
            except (EngineFaultError, DrainingError, APIError) as error:
                yield _event({"error": api_error(error).body})

    # ------------------------------------------------------------------ checks

    async def _body(self, request: Request) -> bytes:
        # Loading and draining first, so that clients retry whatever they sent.
        self.frontend.check_open()
        return await request.body()


def _constraint(call: Call, tokenizer: Any) -> Constraint | None:
    """What the output must match: the request's constraint, or the calls
    its tool choice requires (tools.py), not both."""
    given = protocol.constraint(call.body)
    if call.tools is None:
        return given
    required = tools.constraint(call.tools, tokenizer)
    if given is not None and required is not None:
        raise ValidationError("tool_choice", f"a required tool call and {given.field} "
                              "each constrain the output; give one")
    return given or required


def _echo_text(prompt: Prompt, stream: RequestStream, tokenizer: Any) -> str:
    """The prompt as echo writes it: the text given, else its tokens decoded."""
    if isinstance(prompt, TextPrompt):
        return prompt.text
    if tokenizer is None:
        return ""
    return str(tokenizer.decode(list(stream.prompt_token_ids)))


def _nothing_generated(counts: Usage) -> Usage:
    """The usage of an echo of the prompt alone: the token the engine sampled
    was never the caller's."""
    return dataclasses.replace(counts, completion_tokens=0)


def _check_complete(finish_reasons: list[str]) -> None:
    reason = cut_short(finish_reasons)
    if reason is not None:
        raise APIError(500, ErrorBody(f"{CUT_SHORT[reason]}; finish reasons by sample: "
                                      f"{', '.join(finish_reasons)}", "server_error", None, reason))


def _event(body: Any) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def _json(body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), 200, headers, media_type="application/json")


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """work's result, or None once the client has gone (work cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return None
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body is read: the next message is the disconnect (or the response end).
    while (await request.receive())["type"] != "http.disconnect":
        pass


class BearerToken:
    """Every path but /health needs `Authorization: Bearer <token>`, as gRPC does."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                denied = APIError(401, ErrorBody("missing or wrong bearer token",
                                                 "authentication_error", None,
                                                 "invalid_api_key"))
                await denied.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(frontend: Frontend, served: Served, metrics: Metrics | None,
              token: str | None) -> ASGIApp:
    routes = OpenAIRoutes(frontend, served, metrics)
    tokenize = TokenizeRoutes(frontend, served, routes.ignored)
    paths = [
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/v1/models/{name:path}", routes.model, methods=["GET"]),
        Route("/tokenize", tokenize.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize.detokenize, methods=["POST"]),
        Route("/health", routes.health, methods=["GET"]),
    ]
    if metrics is not None:
        paths.append(Route("/metrics", routes.metrics_text, methods=["GET"]))
    app = Starlette(routes=paths, exception_handlers={
        APIError: _api_error_response,
        ValidationError: _api_error_of,
        LoadingError: _api_error_of,
        DrainingError: _api_error_of,
        HTTPException: _http_error_response,
    })
    return BearerToken(app, token) if token else app


async def _api_error_response(request: Request, error: Exception) -> Response:
    assert isinstance(error, APIError)
    return error.response()


async def _api_error_of(request: Request, error: Exception) -> Response:
    return api_error(error).response()


async def _http_error_response(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    headers = dict(error.headers or {})
    return APIError(error.status_code, ErrorBody(error.detail, kind), headers).response()
