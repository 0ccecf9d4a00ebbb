"""The gRPC side: one channel to the target and one streamed Generate per request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadgen.backend import RequestOptions, TargetError, TargetOptions, new_record
from loadgen.prompts import Conversation
from loadgen.record import RequestRecord
from loadgen.workload import RequestSpec
from specpage.serve.grpc_stubs import generation_pb2 as pb
from specpage.serve.grpc_stubs import generation_pb2_grpc as pb_grpc

SPEC_MODES = {"auto": pb.SPEC_AUTO, "off": pb.SPEC_OFF, "on": pb.SPEC_ON}
HEALTH_SERVICE = "specpage.v1.Generation"
HEALTH_POLL_S = 0.2


def build_request(
    spec: RequestSpec, options: RequestOptions, request_id: str
) -> pb.GenerateRequest:
    sampling = pb.SamplingParameters(max_tokens=spec.max_tokens, ignore_eos=options.ignore_eos)
    if options.request_seeds:
        sampling.seed = spec.seed
    if options.temperature is not None:
        sampling.temperature = options.temperature
    for key, value in spec.sampling.items():  # a trace line's own settings win
        if isinstance(value, list):
            getattr(sampling, key).extend(value)
        else:
            setattr(sampling, key, value)
    request = pb.GenerateRequest(
        request_id=request_id, sampling=sampling, spec=SPEC_MODES[options.spec],
        cache_salt=options.cache_salt,
    )
    if isinstance(spec.prompt, Conversation):
        # chat=true is one user message; RequestFile.check_grpc refused the others.
        text = spec.prompt.lone_user_text()
        assert text is not None, f"{spec.item}: a conversation gRPC cannot carry"
        request.text, request.chat = text, True
    elif isinstance(spec.prompt, str):
        request.text, request.chat = spec.prompt, options.chat
    else:
        request.token_ids.extend(spec.prompt)
    return request


class Client:
    """Streams requests to one target over gRPC and fills in their records (a Backend)."""

    def __init__(self, target: TargetOptions, options: RequestOptions, run_tag: str) -> None:
        self.target = target
        self.options = options
        self.run_tag = run_tag  # keeps request ids unique across concurrent loadgen runs
        self._channel = _channel(target)
        self._stub = pb_grpc.GenerationStub(self._channel)
        token = target.token
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    async def close(self) -> None:
        await self._channel.close()

    async def connect(self, health_timeout_s: float) -> None:
        if health_timeout_s > 0:
            await self.wait_healthy(health_timeout_s)

    def describe(self) -> dict[str, Any]:
        return {"api": "grpc", "address": self.target.address}

    def new_record(self, spec: RequestSpec) -> RequestRecord:
        return new_record(spec, self.run_tag)

    async def wait_healthy(self, timeout_s: float) -> None:
        """Poll grpc.health.v1 until SERVING; a target without the health service passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        stub = health_pb2_grpc.HealthStub(self._channel)
        request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)
        while True:
            try:
                reply = await stub.Check(request, metadata=self._metadata, timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return
                last = f"{error.code().name}: {error.details()}"
            if loop.time() >= deadline:
                raise TargetError(
                    f"{self.target.address} is not serving after {timeout_s:g}s ({last})"
                )
            await asyncio.sleep(HEALTH_POLL_S)

    async def generate(
        self, spec: RequestSpec, record: RequestRecord, clock: Callable[[], float]
    ) -> None:
        """Send one request and record its stream; returns when the stream has ended."""
        request = build_request(spec, self.options, record.request_id)
        record.sent_s = clock()
        call = self._stub.Generate(
            request, metadata=self._metadata, timeout=self.target.request_timeout_s
        )
        timer = None
        if spec.cancel_after_s is not None:
            timer = asyncio.get_running_loop().call_later(
                spec.cancel_after_s, _cancel, call, record
            )
        try:
            final_seen = await _read_stream(call, record, clock)
            record.end_s = clock()
            record.status = grpc.StatusCode.OK.name
            record.outcome = "completed" if final_seen else "error"
            record.error = "" if final_seen else "stream ended without a final event"
        except asyncio.CancelledError:
            record.end_s = clock()
            if record.outcome != "cancelled":
                raise  # not our planned cancel: the run itself is being torn down
        except grpc.aio.AioRpcError as error:
            record.end_s = clock()
            _record_error(record, error)
        finally:
            if timer is not None:
                timer.cancel()


async def _read_stream(
    call: grpc.aio.UnaryStreamCall, record: RequestRecord, clock: Callable[[], float]
) -> bool:
    final_seen = False
    async for event in call:
        now = clock()
        kind = event.WhichOneof("event")
        if kind == "chunk" and event.chunk.index == 0:
            record.add_chunk(now, event.chunk.num_tokens)
            record.finish_reason = event.chunk.finish_reason or record.finish_reason
        elif kind == "final":
            final_seen = True
            _record_final(record, event.final)
    return final_seen


def _record_final(record: RequestRecord, final: pb.Final) -> None:
    usage, timings = final.usage, final.timings
    record.finish_reason = final.finish_reason or record.finish_reason
    record.prompt_tokens = usage.prompt_tokens
    record.completion_tokens = usage.completion_tokens
    record.cached_tokens = usage.cached_tokens
    record.drafted_tokens = usage.drafted_tokens
    record.accepted_tokens = usage.accepted_tokens
    record.queue_s = timings.queue_s
    record.prefill_s = timings.prefill_s
    record.server_total_s = timings.total_s


def _record_error(record: RequestRecord, error: grpc.aio.AioRpcError) -> None:
    record.status = error.code().name
    record.error = error.details() or ""
    record.outcome = "error"
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after-ms":
            try:
                record.retry_after_ms = int(value)
            except ValueError:
                record.error += f" (unreadable retry-after-ms {value!r})"


def _cancel(call: grpc.aio.UnaryStreamCall, record: RequestRecord) -> None:
    # Only a cancel that took effect counts: a finished stream stays completed.
    if call.cancel():
        record.outcome, record.status = "cancelled", grpc.StatusCode.CANCELLED.name


def _channel(target: TargetOptions) -> grpc.aio.Channel:
    if not target.tls:
        return grpc.aio.insecure_channel(target.address)
    credentials = grpc.ssl_channel_credentials(root_certificates=target.tls_ca_pem)
    return grpc.aio.secure_channel(target.address, credentials)
