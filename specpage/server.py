"""The gRPC servicer: requests in, event streams out, errors as status codes."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from specpage.async_engine import (
    AsyncEngine,
    Chunk,
    DrainingError,
    EngineFaultError,
    Final,
    QueueFullError,
)
from specpage.completion import Durations
from specpage.request import Request, SamplingParams, ValidationError
from specpage.v1 import generation_pb2 as pb
from specpage.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("specpage.server")
# Request ids are echoed as gRPC metadata, whose values must be printable
# ASCII; 128 characters hold a UUID or a W3C trace id with room to spare.
MAX_REQUEST_ID_LENGTH = 128
# A text prompt of more bytes than max_prompt_tokens x this cannot fit and is
# refused before it is tokenized. SmolLM2's longest token is 81 bytes; common
# byte-level BPE vocabularies stay under 128 too, so no prompt that fits is refused.
PROMPT_BYTES_PER_TOKEN = 128
# Requests tokenized at once, off the event loop, by threads of their own. Fast
# tokenizers release the GIL while they encode, so each one takes a core from
# the engine's step thread. A pool this size bounds them however calls end: a
# cancelled call cannot stop the thread tokenizing its prompt, only free its
# place in a queue, so a semaphore around shared threads would let a client that
# cancels at once keep any number of them busy.
PREPARE_CONCURRENCY = 2
# The salt goes into the hash of every prefix-cache block key, on the engine's
# step thread: a tenant id is short, and a long salt would slow every stream.
MAX_CACHE_SALT_BYTES = 256


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise ValidationError("request_id", f"{len(request_id)} characters exceed the limit "
                              f"of {MAX_REQUEST_ID_LENGTH}")
    bad = next((c for c in request_id if not " " <= c <= "~"), None)
    if bad is not None:
        raise ValidationError("request_id", f"character U+{ord(bad):04X} is not printable "
                              "ASCII (0x20-0x7E)")


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
    )


class GenerationService(pb_grpc.GenerationServicer):
    """Answers UNAVAILABLE until an engine is attached (models loading)."""

    def __init__(
        self,
        info: Callable[[AsyncEngine], pb.ServerInfo],
        max_prompt_tokens: int,
        on_first_token: Callable[[float], None] = lambda s: None,
    ) -> None:
        self._engine: AsyncEngine | None = None
        self.info = info
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_bytes = max_prompt_tokens * PROMPT_BYTES_PER_TOKEN
        self.on_first_token = on_first_token
        self.in_flight = 0
        self._preparing = ThreadPoolExecutor(PREPARE_CONCURRENCY,
                                             thread_name_prefix="specpage-prepare")

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def close(self) -> None:
        """Drop the prompts still queued for tokenizing (their calls have ended)."""
        self._preparing.shutdown(wait=False, cancel_futures=True)

    @property
    def engine(self) -> AsyncEngine:
        assert self._engine is not None
        return self._engine

    async def Generate(  # noqa: N802 (the gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        arrival = time.monotonic()  # queue, end-to-end and first-token times count from here
        request_id = await _checked_id(request.request_id or uuid.uuid4().hex, context)
        await context.send_initial_metadata((("request-id", request_id),))
        stream = await self._admit(request, request_id, context, arrival)
        self.in_flight += 1
        start = arrival
        try:
            async for event in stream.events():
                if isinstance(event, Chunk):
                    if start and event.token_ids:
                        self.on_first_token(time.monotonic() - start)
                        start = 0.0
                    yield pb.GenerateEvent(chunk=_chunk(event))
                else:
                    # Every sample's chunks, each with its finish reason, are
                    # sent by now; a request cut short ends with its status
                    # instead of a Final event.
                    code = _status(event.finish_reasons)
                    if code is not grpc.StatusCode.OK:
                        await context.abort(code, _cut_short(request_id, event.finish_reasons))
                    yield pb.GenerateEvent(final=_final(event))
        except EngineFaultError as error:
            await context.abort(grpc.StatusCode.INTERNAL, str(error))
        except DrainingError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        finally:
            # A cancelled call, a passed deadline or a vanished client all
            # end here: the engine frees the blocks at its next step. Only
            # this call's own stream: the id may already be reused.
            if self.engine.streams.get(request_id) is stream:
                self.engine.abort(request_id)
            self.in_flight -= 1

    async def _admit(self, request: pb.GenerateRequest, request_id: str,
                     context: grpc.aio.ServicerContext, arrival: float) -> Any:
        if self._engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the models are loading")
        if self.engine.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is draining")
        try:
            k = spec_k(request.spec, self.engine.engine.policy.k_max)
            deadline = _deadline(request, context)
            # Tokenizing and templating take seconds for megabytes of text: the
            # event loop must keep answering health checks and streams meanwhile.
            # A call cancelled while its prompt waits for a thread drops it from
            # the queue; one already tokenizing runs to its end on its thread.
            made = await asyncio.get_running_loop().run_in_executor(
                self._preparing, self._make_request, request, request_id, deadline, arrival)
            made.spec_k = k
            return self.engine.submit(made)
        except ValidationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except QueueFullError as error:
            context.set_trailing_metadata((("retry-after-ms", str(error.retry_after_ms)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except DrainingError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))

    def _make_request(self, request: pb.GenerateRequest, request_id: str,
                      deadline: float | None, arrival: float) -> Request:
        """All the work that grows with the request; runs off the event loop."""
        salt = request.cache_salt.encode()
        if len(salt) > MAX_CACHE_SALT_BYTES:
            raise ValidationError("cache_salt", f"{len(salt)} bytes exceed the limit of "
                                  f"{MAX_CACHE_SALT_BYTES}")
        prompt_field = "token_ids" if request.token_ids else "text"
        made = self.engine.engine.make_request(
            request_id, self._prompt(request), sampling_params(request.sampling),
            request.priority, deadline, prompt_field=prompt_field, arrival=arrival)
        if len(made.prompt_token_ids) > self.max_prompt_tokens:
            raise ValidationError(prompt_field, f"{len(made.prompt_token_ids)} tokens exceed "
                                  f"the limit of {self.max_prompt_tokens}")
        made.cache_salt = salt
        return made

    def _prompt(self, request: pb.GenerateRequest) -> str | list[int]:
        """The prompt, refused by its size before any per-token work."""
        if request.text and request.token_ids:
            raise ValidationError("prompt", "give text or token_ids, not both")
        if not (request.text or request.token_ids or request.chat):
            raise ValidationError("prompt", "give text or token_ids")
        if len(request.token_ids) > self.max_prompt_tokens:
            raise ValidationError("token_ids", f"{len(request.token_ids)} tokens exceed the "
                                  f"limit of {self.max_prompt_tokens}")
        if request.token_ids:
            if request.chat:
                raise ValidationError("chat", "the chat template wraps text, not token_ids")
            return list(request.token_ids)
        size = len(request.text.encode())
        if size > self.max_prompt_bytes:
            raise ValidationError("text", f"{size} bytes exceed the limit of "
                                  f"{self.max_prompt_bytes} ({self.max_prompt_tokens} tokens)")
        prompt: str | list[int]
        if request.chat:
            tokenizer = self.engine.engine.tokenizer
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                raise ValidationError("chat", "the model has no chat template")
            from specpage.llm import chat_prompt

            prompt = chat_prompt(tokenizer, request.text)
        else:
            prompt = request.text
        return prompt

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        request_id = await _checked_id(request.request_id, context)
        found = self._engine is not None and self.engine.abort(request_id)
        return pb.AbortResponse(found=found)

    async def GetServerInfo(  # noqa: N802
        self, request: pb.ServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        if self._engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the models are loading")
        return self.info(self.engine)


async def _checked_id(request_id: str, context: grpc.aio.ServicerContext) -> str:
    """The id, checked before anything echoes it in metadata."""
    try:
        check_request_id(request_id)
    except ValidationError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    return request_id


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


def _chunk(chunk: Chunk) -> pb.Chunk:
    return pb.Chunk(index=chunk.index, token_ids=chunk.token_ids, text=chunk.text,
                    num_tokens=chunk.num_tokens, logprobs=chunk.logprobs,
                    finish_reason=chunk.finish_reason or "")


# A request ends with the status of its worst-ended sample: a fault beats a
# deadline, which beats everything else (stop, length, and abort, which a
# caller asked for and gets with OK and the Final event).
ENDING_STATUS = {"error": grpc.StatusCode.INTERNAL, "timeout": grpc.StatusCode.DEADLINE_EXCEEDED}


def _status(finish_reasons: list[str]) -> grpc.StatusCode:
    for reason, code in ENDING_STATUS.items():
        if reason in finish_reasons:
            return code
    return grpc.StatusCode.OK


def _cut_short(request_id: str, finish_reasons: list[str]) -> str:
    what = "failed" if "error" in finish_reasons else "passed its timeout"
    return f"request {request_id} {what}; finish reasons by sample: {', '.join(finish_reasons)}"


def _final(final: Final) -> pb.Final:
    usage, durations = final.usage, Durations.of(final.timings)
    return pb.Final(
        usage=pb.Usage(prompt_tokens=usage.prompt_tokens,
                       completion_tokens=usage.completion_tokens,
                       cached_tokens=usage.cached_tokens, drafted_tokens=usage.drafted_tokens,
                       accepted_tokens=usage.accepted_tokens),
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


async def wait_idle(service: GenerationService, grace: float) -> bool:
    """Wait until no call is in flight, at most grace seconds."""
    end = time.monotonic() + grace
    while service.in_flight and time.monotonic() < end:
        await asyncio.sleep(0.05)
    return service.in_flight == 0
