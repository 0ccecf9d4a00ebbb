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
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
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

from specpage.core.request import ValidationError
from specpage.engine.async_engine import (
    Chunk,
    DrainingError,
    EngineFaultError,
    RequestStream,
)
from specpage.engine.submission import (
    ChatPrompt,
    Prompt,
    RequestOptions,
    TextPrompt,
    TokenPrompt,
)
from specpage.serve.frontend import Frontend, LoadingError, check_request_id, cut_short
from specpage.serve.metrics import Metrics
from specpage.serve.openai_api import protocol
from specpage.serve.openai_api.errors import APIError, ErrorBody, api_error, invalid
from specpage.serve.openai_api.render import Renderer, Sample

T = TypeVar("T")
# Paths a load balancer probes without credentials, as gRPC health is open.
OPEN_PATHS = frozenset({"/health"})
# nginx's status for a client that went away before its response: logged, never seen.
CLIENT_CLOSED_REQUEST = 499
# What a request cut short (see frontend.cut_short) was cut by.
CUT_SHORT = {"error": "the engine failed while generating", "timeout": "the request timed out"}


@dataclass(frozen=True)
class Served:
    """What the routes say about the daemon."""

    model: str  # model.target exactly as configured: the only `model` accepted
    draft: str | None
    created: int = 0  # Unix time the daemon started


class OpenAIRoutes:
    def __init__(self, frontend: Frontend, served: Served, metrics: Metrics | None) -> None:
        self.frontend = frontend
        self.served = served
        self.metrics = metrics

    # ------------------------------------------------------------------ endpoints

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = protocol.decode(await self._body(request), protocol.ChatCompletionRequest)
        self._check_model(body.model)
        protocol.check_supported(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None and (
                body.max_tokens != body.max_completion_tokens):
            raise invalid("max_completion_tokens", "max_completion_tokens and max_tokens "
                          "differ; give one")
        max_tokens = (body.max_tokens if body.max_completion_tokens is None
                      else body.max_completion_tokens)  # None: as many as the context leaves
        prompt = ChatPrompt(protocol.chat_messages(body.messages))
        renamed = {"max_tokens": "max_completion_tokens"
                   if body.max_completion_tokens is not None else "max_tokens"}
        return await self._serve(request, body, prompt, max_tokens, arrival, renamed)

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = protocol.decode(await self._body(request), protocol.CompletionRequest)
        self._check_model(body.model)
        protocol.check_supported(body)
        # OpenAI's default for completions is 16 tokens, the engine's too.
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return await self._serve(request, body, _completion_prompt(body.prompt), max_tokens,
                                 arrival, {})

    async def models(self, request: Request) -> Response:
        served = self.served
        max_context = self.frontend.engine.max_context if self.frontend.ready else None
        card = {"id": served.model, "object": "model", "created": served.created,
                "owned_by": "specpage", "max_model_len": max_context,
                "metadata": {"draft": served.draft}}
        return _json({"object": "list", "data": [card]})

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

    async def _serve(self, request: Request,
                     body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
                     prompt: Prompt, max_tokens: int | None, arrival: float,
                     renamed: dict[str, str]) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        renamed = {"request_id": "X-Request-Id", **renamed}
        chat = isinstance(body, protocol.ChatCompletionRequest)
        field = "messages" if chat else "prompt"  # a conversation's template errors too
        try:
            check_request_id(request_id)
            params = protocol.sampling_params(body, max_tokens)
            options = RequestOptions(
                request_id, arrival, priority=body.priority, cache_salt=body.cache_salt or "",
                cache_text=not body.no_suffix_cache,
                max_tokens_to_context=max_tokens is None, prompt_field=field, chat_field=field)
            stream = await self.frontend.engine.add_request(prompt, params, options)
        except Exception as error:  # noqa: BLE001 (api_error re-raises what it cannot map)
            raise api_error(error, renamed) from None
        tokenizer = self.frontend.engine.tokenizer
        renderer = Renderer(
            chat=chat, request_id=request_id, model=self.served.model, logprobs=params.logprobs,
            token_text=(lambda t: tokenizer.decode([t])) if tokenizer is not None
            else (lambda t: f"token_id:{t}"))
        headers = {"X-Request-Id": request_id}
        if body.stream:
            include_usage = (body.stream_options is not None
                             and body.stream_options.include_usage)
            return StreamingResponse(self._events(stream, renderer, arrival, include_usage),
                                     headers=headers, media_type="text/event-stream")
        async with self.frontend.running(stream):
            samples = [Sample() for _ in range(params.n)]
            final = await _unless_disconnected(
                request, self._collect(stream, samples, arrival))
        if final is None:  # nobody is there to read a response
            return Response(b"", CLIENT_CLOSED_REQUEST)
        return _json(renderer.response(samples, final), headers)

    async def _collect(self, stream: RequestStream, samples: list[Sample],
                       arrival: float) -> Any:
        try:
            async for event in self.frontend.events(stream, arrival):
                if isinstance(event, Chunk):
                    samples[event.index].add(event)
                else:
                    _check_complete(event.finish_reasons)
                    return event.usage
        except (EngineFaultError, DrainingError) as error:
            raise api_error(error) from None
        raise AssertionError("a stream ends with its Final event or an error")

    async def _events(self, stream: RequestStream, renderer: Renderer, arrival: float,
                      include_usage: bool) -> AsyncIterator[bytes]:
        # Runs as the response's body; a client that disconnects cancels it here.
        # Nothing is sent before the engine's first output: a chat choice's
        # role goes with its first chunk (see Renderer.chunk).
        opened: set[int] = set()  # the choices whose first chunk is sent
        async with self.frontend.running(stream):
            try:
                async for event in self.frontend.events(stream, arrival):
                    if isinstance(event, Chunk):
                        yield _event(renderer.chunk(event, opens=event.index not in opened))
                        opened.add(event.index)
                        continue
                    _check_complete(event.finish_reasons)
                    if include_usage:
                        yield _event(renderer.usage_chunk(event.usage))
                yield b"data: [DONE]\n\n"
            except (EngineFaultError, DrainingError, APIError) as error:
                yield _event({"error": api_error(error).body})

    # ------------------------------------------------------------------ checks

    async def _body(self, request: Request) -> bytes:
        # Loading and draining first, so that clients retry whatever they sent.
        self.frontend.check_open()
        return await request.body()

    def _check_model(self, model: str | None) -> None:
        # An absent or empty model means the one served (vLLM requires the
        # name; curl users often leave it out). Any other name is not here.
        if model and model != self.served.model:
            raise APIError(404, ErrorBody(
                f"the model {model!r} does not exist; this server serves {self.served.model!r}",
                "invalid_request_error", "model", "model_not_found"))


def _completion_prompt(prompt: str | list[int | str | list[int]]) -> Prompt:
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    if all(isinstance(token, int) for token in prompt):
        return TokenPrompt(prompt)  # type: ignore[arg-type]
    if len(prompt) != 1:  # a batch would be several requests under one id
        raise ValidationError("prompt", f"one prompt per request, got {len(prompt)}")
    only = prompt[0]
    if isinstance(only, str):
        return TextPrompt(only)
    if isinstance(only, list):
        return TokenPrompt(only)
    raise ValidationError("prompt", "text, token ids, or a list of one of those")


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
    paths = [
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
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
