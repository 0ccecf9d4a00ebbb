"""Async Python client of the specpage daemon.

    async with Client("127.0.0.1:50051") as client:
        async for event in client.generate("Hello", chat=True, max_tokens=32):
            if isinstance(event, Chunk):
                print(event.text, end="")
        completion = await client.complete("Hi", chat=True, max_tokens=8)
        print(completion.text, completion.usage.completion_tokens)

`complete` returns the same `Completion` as the in-process `LLM.generate`.

Leaving the ``async for`` early or cancelling the task cancels the call, and
the server aborts the request. Calls that fail before any event with
UNAVAILABLE or RESOURCE_EXHAUSTED are retried with backoff (honouring the
server's ``retry-after-ms``); nothing else is retried. A request that
`complete` sees cut short raises `IncompleteError`, which keeps what arrived.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from specpage.completion import Completion, Durations
from specpage.core.request import TokenLogprobs, Usage
from specpage.serve.grpc_stubs import generation_pb2 as pb
from specpage.serve.grpc_stubs import generation_pb2_grpc as pb_grpc

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
SPEC = {"auto": pb.SPEC_AUTO, "off": pb.SPEC_OFF, "on": pb.SPEC_ON}


@dataclass(frozen=True)
class Chunk:
    index: int
    token_ids: list[int]
    text: str
    num_tokens: int  # cumulative completion tokens of this sample
    logprobs: list[float]
    finish_reason: str | None
    # with top_logprobs: per token, the likeliest (token id, log-probability) there
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # with prompt_logprobs, on the sample's first chunk: position by position
    # (None at 0, which nothing predicts)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_token_ids: list[int] = field(default_factory=list)  # with prompt_logprobs


@dataclass(frozen=True)
class Final:
    """The request ended OK (a request cut short ends with its status)."""

    finish_reason: str  # sample 0's
    finish_reasons: list[str]  # every sample's, by index
    usage: Usage
    timings: Durations


class IncompleteError(grpc.aio.AioRpcError):
    """The call ended with an error status (a timeout, an engine fault, ...).

    ``completion`` holds what arrived before it: every sample's tokens, text,
    log-probabilities and the finish reasons of the samples that ended.
    Usage and timings come only with a Final event, so they stay unset."""

    def __init__(self, error: grpc.aio.AioRpcError, completion: Completion) -> None:
        super().__init__(error.code(), error.initial_metadata(), error.trailing_metadata(),
                         error.details(), error.debug_error_string())
        self.completion = completion


def generate_request(prompt: str | Sequence[int], request_id: str = "", chat: bool = False,
                     priority: int = 0, timeout_s: float | None = None, spec: str = "auto",
                     cache_salt: str = "", no_suffix_cache: bool = False,
                     constraint: dict[str, Any] | None = None,
                     **sampling: Any) -> pb.GenerateRequest:
    """A GenerateRequest; sampling keywords are SamplingParameters fields
    (max_tokens, temperature, top_k, top_p, seed (-1: none), stop,
    stop_token_ids, ignore_eos, n, logprobs, presence_penalty,
    frequency_penalty, repetition_penalty, min_p, min_tokens, logit_bias as
    {token id: bias}, top_logprobs (with logprobs: the likeliest tokens at each
    output position), prompt_logprobs (the prompt's, with this many
    alternatives per position; the request then takes no prefix-cache
    hit)); cache_salt isolates a tenant's prefix-cache and suffix-cache
    entries; no_suffix_cache keeps the request's text out of the suffix
    cache; constraint: what the output must match, one of
    {"json_schema": schema (an object or JSON text)}, {"json_object": True},
    {"regex": pattern}, {"choice": [strings]}, {"grammar": GBNF or Lark}."""
    if sampling.get("seed") == -1:  # no seed, as OpenAI's and vLLM's clients say it
        del sampling["seed"]
    message = pb.GenerateRequest(request_id=request_id, chat=chat, priority=priority,
                                 spec=SPEC[spec], cache_salt=cache_salt,
                                 no_suffix_cache=no_suffix_cache,
                                 sampling=pb.SamplingParameters(**sampling))
    if constraint is not None:
        message.constraint.CopyFrom(_constraint(constraint))
    if isinstance(prompt, str):
        message.text = prompt
    else:
        message.token_ids.extend(prompt)
    if timeout_s is not None:
        message.timeout_s = timeout_s
    return message


def _constraint(given: dict[str, Any]) -> pb.Constraint:
    if len(given) != 1:
        raise ValueError(f"a constraint has one kind, got {sorted(given)}")
    ((kind, value),) = given.items()
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if kind == "choice":
        return pb.Constraint(choice=pb.Choices(values=list(value)))
    return pb.Constraint(**{kind: value})


class Client:
    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, max_retries: int = 4,
                 backoff_s: float = 0.2) -> None:
        if tls:
            credentials = grpc.ssl_channel_credentials(root_certificates)
            self.channel = grpc.aio.secure_channel(target, credentials)
        else:
            self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.max_retries = max_retries
        self.backoff_s = backoff_s

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(
        self, prompt: str | Sequence[int], *, chat: bool = False,
        deadline_s: float | None = None, **options: Any,
    ) -> AsyncIterator[Chunk | Final]:
        """Events of one request: chunks, then a Final event.

        chat: wrap a text prompt in the model's chat template, as one user
        message (the daemon refuses it if the model has none); False sends
        the text as it is. Token-id prompts are never wrapped.
        options: request_id, priority, timeout_s, spec ("auto", "on", "off"),
        cache_salt, no_suffix_cache and SamplingParameters fields (max_tokens,
        temperature, n, presence_penalty, logit_bias, ...: see
        `generate_request`)."""
        message = generate_request(prompt, chat=chat, **options)
        for attempt in range(self.max_retries + 1):
            call = self.stub.Generate(message, timeout=deadline_s, metadata=self.metadata)
            started = False
            try:
                async for event in call:
                    started = True
                    yield _event(event)
                return
            except grpc.aio.AioRpcError as error:
                if started or error.code() not in RETRYABLE or attempt == self.max_retries:
                    raise
                await asyncio.sleep(self._delay(error, attempt))
            finally:
                call.cancel()  # no-op once finished; aborts the request if we left early

    async def complete(self, prompt: str | Sequence[int], *, chat: bool = False,
                       **options: Any) -> Completion:
        """Run one request to its end: every sample, usage and timings.

        chat: wrap a text prompt in the model's chat template, as one user
        message (the daemon refuses it if the model has none); False sends
        the text as it is. Token-id prompts are never wrapped.
        options: as for `generate`. A request cut short raises its status
        as an `IncompleteError` holding the samples as far as they came."""
        completion = Completion(options.get("request_id", ""))
        try:
            async for event in self.generate(prompt, chat=chat, **options):
                if isinstance(event, Chunk):
                    completion.add(event.index, event.token_ids, event.text, event.logprobs,
                                   event.finish_reason)
                    sample = completion.sample(event.index)
                    sample.top_logprobs += event.top_logprobs
                    if event.prompt_logprobs is not None:
                        sample.prompt_logprobs = event.prompt_logprobs
                else:
                    for index, reason in enumerate(event.finish_reasons):
                        completion.sample(index).finish_reason = reason
                    completion.usage, completion.timings = event.usage, event.timings
        except grpc.aio.AioRpcError as error:
            raise IncompleteError(error, completion) from error
        return completion

    async def abort(self, request_id: str) -> bool:
        response = await self.stub.Abort(pb.AbortRequest(request_id=request_id),
                                         metadata=self.metadata)
        return bool(response.found)

    async def server_info(self) -> pb.ServerInfo:
        info: pb.ServerInfo = await self.stub.GetServerInfo(pb.ServerInfoRequest(),
                                                            metadata=self.metadata)
        return info

    def _delay(self, error: grpc.aio.AioRpcError, attempt: int) -> float:
        for key, value in error.trailing_metadata() or ():
            if key == "retry-after-ms":
                return float(value) / 1000
        return self.backoff_s * 2**attempt * (0.5 + random.random())


def _top(top: Iterable[pb.TokenLogprob]) -> list[tuple[int, float]]:
    return [(t.token_id, t.logprob) for t in top]


def _event(event: pb.GenerateEvent) -> Chunk | Final:
    if event.HasField("chunk"):
        c = event.chunk
        prompt = None
        if c.prompt_token_ids:  # sent with the prompt's log-probabilities
            prompt = [None, *(TokenLogprobs(p.logprob, p.rank, _top(p.top))
                              for p in c.prompt_logprobs)]
        return Chunk(c.index, list(c.token_ids), c.text, c.num_tokens, list(c.logprobs),
                     c.finish_reason or None, [_top(t.top) for t in c.top_logprobs], prompt,
                     list(c.prompt_token_ids))
    f = event.final
    usage = Usage(prompt_tokens=f.usage.prompt_tokens,
                  completion_tokens=f.usage.completion_tokens,
                  cached_tokens=f.usage.cached_tokens, drafted_tokens=f.usage.drafted_tokens,
                  accepted_tokens=f.usage.accepted_tokens,
                  by_method={m.method: [m.drafted_tokens, m.accepted_tokens]
                             for m in f.usage.by_method})
    timings = Durations(queue_s=f.timings.queue_s, prefill_s=f.timings.prefill_s,
                        total_s=f.timings.total_s)
    # A server older than finish_reasons sends sample 0's alone.
    reasons = list(f.finish_reasons) or [f.finish_reason]
    return Final(f.finish_reason, reasons, usage, timings)
