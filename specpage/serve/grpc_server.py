"""The gRPC servicer: requests in, event streams out, errors as status codes."""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from specpage.completion import Durations
from specpage.core import grammar
from specpage.core.grammar import Constraint
from specpage.core.request import SamplingParams, ValidationError
from specpage.engine.async_engine import (
    AsyncEngine,
    Chunk,
    DrainingError,
    EngineFaultError,
    Final,
    QueueFullError,
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
from specpage.serve.grpc_stubs import generation_pb2 as pb
from specpage.serve.grpc_stubs import generation_pb2_grpc as pb_grpc

log = logging.getLogger("specpage.serve.grpc_server")


def spec_k(mode: int, k_max: int) -> int | None:
    """The largest k a request's SpecMode allows; None leaves k to the policy."""
    choices: dict[int, int | None] = {pb.SPEC_AUTO: None, pb.SPEC_OFF: 0, pb.SPEC_ON: k_max}
    if mode not in choices:  # proto3 enums are open: any int arrives
        known = ", ".join(f"{pb.SpecMode.Name(m)} = {m}" for m in choices)
        raise ValidationError("spec", f"unknown mode {mode}; known: {known}")
    return choices[mode]


def sampling_params(message: pb.SamplingParameters) -> SamplingParams:
    """Proto fields -> SamplingParams; absent optional fields keep the defaults."""
    defaults = SamplingParams()

    def get(name: str, default: Any) -> Any:
        return getattr(message, name) if message.HasField(name) else default

    return SamplingParams(
        max_tokens=get("max_tokens", defaults.max_tokens),
        temperature=get("temperature", defaults.temperature),
        top_k=message.top_k,
        top_p=get("top_p", defaults.top_p),
        seed=get("seed", None),
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        n=get("n", defaults.n),
        logprobs=message.logprobs,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=get("repetition_penalty", defaults.repetition_penalty),
        min_p=message.min_p,
        min_tokens=message.min_tokens,
        logit_bias=dict(message.logit_bias),
        top_logprobs=message.top_logprobs,
        prompt_logprobs=get("prompt_logprobs", None),
    )


class GenerationService(pb_grpc.GenerationServicer):
    """Answers UNAVAILABLE until an engine is attached (models loading).

    Proto messages in and out, errors as status codes; what a request goes
    through on its way to the engine is `AsyncEngine.add_request`'s, shared
    with HTTP."""

    def __init__(self, info: Callable[[AsyncEngine], pb.ServerInfo], frontend: Frontend) -> None:
        self.info = info
        self.frontend = frontend

    def attach(self, engine: AsyncEngine) -> None:
        self.frontend.attach(engine)

    @property
    def engine(self) -> AsyncEngine:
        return self.frontend.engine

    async def Generate(  # noqa: N802 (the gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        arrival = time.monotonic()  # queue, end-to-end and first-token times count from here
        request_id = await _checked_id(request.request_id or uuid.uuid4().hex, context)
        await context.send_initial_metadata((("request-id", request_id),))
        stream = await self._admit(request, request_id, context, arrival)
        # A cancelled call, a passed deadline or a vanished client all leave
        # this block: the engine frees the blocks at its next step.
        async with self.frontend.running(stream):
            try:
                async for event in self.frontend.events(stream, arrival):
                    if isinstance(event, Chunk):
                        yield pb.GenerateEvent(chunk=_chunk(event, stream.prompt_token_ids))
                        continue
                    # Every sample's chunks, each with its finish reason, are
                    # sent by now; a request cut short ends with its status
                    # instead of a Final event.
                    reason = cut_short(event.finish_reasons)
                    if reason is not None:
                        code, what = ENDING_STATUS[reason]
                        await context.abort(code, f"request {request_id} {what}; finish "
                                            f"reasons by sample: {', '.join(event.finish_reasons)}")
                    yield pb.GenerateEvent(final=_final(event))
            except EngineFaultError as error:
                await context.abort(grpc.StatusCode.INTERNAL, str(error))
            except DrainingError as error:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))

    async def _admit(self, request: pb.GenerateRequest, request_id: str,
                     context: grpc.aio.ServicerContext, arrival: float) -> RequestStream:
        try:
            self.frontend.check_open()
            prompt, field = _prompt(request)
            params = sampling_params(request.sampling)
            options = RequestOptions(
                request_id, arrival, priority=request.priority,
                deadline=_deadline(request, context), cache_salt=request.cache_salt,
                cache_text=not request.no_suffix_cache,
                spec_k=spec_k(request.spec, self.engine.k_max), prompt_field=field,
                constraint=constraint_of(request))
            return await self.engine.add_request(prompt, params, options)
        except ValidationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except QueueFullError as error:
            context.set_trailing_metadata((("retry-after-ms", str(error.retry_after_ms)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except (LoadingError, DrainingError) as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        raise AssertionError("context.abort raises")

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        request_id = await _checked_id(request.request_id, context)
        found = self.frontend.ready and self.engine.abort(request_id)
        return pb.AbortResponse(found=found)

    async def GetServerInfo(  # noqa: N802
        self, request: pb.ServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        if not self.frontend.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the models are loading")
        return self.info(self.engine)


async def _checked_id(request_id: str, context: grpc.aio.ServicerContext) -> str:
    """The id, checked before anything echoes it in metadata."""
    try:
        check_request_id(request_id)
    except ValidationError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    return request_id


def constraint_of(request: pb.GenerateRequest) -> Constraint | None:
    """The request's Constraint message as core/grammar.py's, if it has one."""
    if not request.HasField("constraint"):
        return None
    given = request.constraint
    kind = given.WhichOneof("kind")
    field = f"constraint.{kind}"
    if kind is None:
        raise ValidationError("constraint", "set one of json_schema, json_object, regex, "
                              "choice or grammar")
    if kind == "json_schema":
        return grammar.json_schema(given.json_schema, field)
    if kind == "json_object":
        if not given.json_object:
            raise ValidationError(field, "must be true when set")
        return Constraint("json_object", field=field)
    if kind == "choice":
        return Constraint("choice", choices=tuple(given.choice.values), field=field)
    return Constraint(kind, getattr(given, kind), field=field)


def _prompt(request: pb.GenerateRequest) -> tuple[Prompt, str]:
    """Which prompt the message carries, and its field; sizing and tokenizing
    are the engine's. With `chat`, the text is one user message."""
    if request.text and request.token_ids:
        raise ValidationError("prompt", "give text or token_ids, not both")
    if not (request.text or request.token_ids or request.chat):
        raise ValidationError("prompt", "give text or token_ids")
    if request.token_ids:
        if request.chat:
            raise ValidationError("chat", "the chat template wraps text, not token_ids")
        return TokenPrompt(request.token_ids), "token_ids"
    if request.chat:
        return ChatPrompt([{"role": "user", "content": request.text}]), "text"
    return TextPrompt(request.text), "text"


def _deadline(request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> float | None:
    """The earlier of the call's deadline and the request's own timeout."""
    limits = []
    remaining = context.time_remaining()
    if remaining is not None and math.isfinite(remaining):
        limits.append(remaining)
    if request.HasField("timeout_s"):
        if not 0 < request.timeout_s < math.inf:
            raise ValidationError("timeout_s",
                                  f"must be a finite number > 0, got {request.timeout_s}")
        limits.append(request.timeout_s)
    return time.monotonic() + min(limits) if limits else None


def _chunk(chunk: Chunk, prompt_token_ids: tuple[int, ...]) -> pb.Chunk:
    """prompt_token_ids: the request's, sent with the prompt's log-probabilities."""
    prompt = chunk.prompt_logprobs
    return pb.Chunk(
        index=chunk.index, token_ids=chunk.token_ids, text=chunk.text,
        num_tokens=chunk.num_tokens, logprobs=chunk.logprobs,
        finish_reason=chunk.finish_reason or "",
        top_logprobs=[pb.TopLogprobs(top=_top(top)) for top in chunk.top_logprobs],
        prompt_logprobs=[pb.PromptLogprob(logprob=p.logprob, rank=p.rank, top=_top(p.top))
                         for p in (prompt or [])[1:] if p is not None],
        prompt_token_ids=prompt_token_ids if prompt is not None else ())


def _top(top: list[tuple[int, float]]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=token, logprob=logprob) for token, logprob in top]


# A request cut short (see frontend.cut_short) ends with this status, after its
# chunks; an abort, which a caller asked for, ends OK with the Final event.
ENDING_STATUS = {"error": (grpc.StatusCode.INTERNAL, "failed"),
                 "timeout": (grpc.StatusCode.DEADLINE_EXCEEDED, "passed its timeout")}


def _final(final: Final) -> pb.Final:
    usage, durations = final.usage, Durations.of(final.timings)
    return pb.Final(
        usage=pb.Usage(prompt_tokens=usage.prompt_tokens,
                       completion_tokens=usage.completion_tokens,
                       cached_tokens=usage.cached_tokens, drafted_tokens=usage.drafted_tokens,
                       accepted_tokens=usage.accepted_tokens,
                       by_method=[pb.MethodCounts(method=method, drafted_tokens=drafted,
                                                  accepted_tokens=accepted)
                                  for method, (drafted, accepted) in usage.by_method.items()]),
        timings=pb.Timings(queue_s=durations.queue_s, prefill_s=durations.prefill_s,
                           total_s=durations.total_s),
        finish_reason=final.finish_reason,
        finish_reasons=final.finish_reasons,
    )


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health checks needs `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        metadata = dict(details.invocation_metadata or ())
        if details.method.startswith("/grpc.health.v1.") or (
            metadata.get("authorization") == self.expected
        ):
            return await continuation(details)
        return _deny(details.method)


def _deny(method: str) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        yield  # pragma: no cover (makes this an async generator)

    if method.endswith("/Generate"):
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)
