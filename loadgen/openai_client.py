"""The OpenAI-compatible HTTP side: one connection pool to the target and one streamed
completion per request.

Text prompts with --chat go to /v1/chat/completions as one user message (the
server applies its chat template, as gRPC's `chat=true` does), and conversations
from --requests-file as their messages; every other prompt goes to
/v1/completions as `prompt`, text or token ids. Streams ask for
`stream_options.include_usage`, so the last chunk carries the server's token
counts, and the request's tokens are those counts, never the number of chunks.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

from loadgen.backend import RequestOptions, TargetError, TargetOptions, new_record
from loadgen.prompts import Conversation
from loadgen.record import RequestRecord
from loadgen.sse import DONE, event_data
from loadgen.workload import RequestSpec

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"  # specpage and vLLM; a server without it is checked on MODELS_PATH
HEALTH_POLL_S = 0.2
PROBE_TIMEOUT_S = 1.0  # one health request
# google.rpc's HTTP mapping, so that a run over either API counts errors under one name.
HTTP_STATUS_NAMES = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
    404: "NOT_FOUND", 409: "ABORTED", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED",
    500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}
MS_PER_S = 1000


class StreamError(Exception):
    """The stream failed: a status name as the gRPC side would give it, and the message."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


def build_body(
    spec: RequestSpec, options: RequestOptions, model: str
) -> tuple[str, dict[str, Any]]:
    """The endpoint path and JSON body for one request."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": spec.max_tokens, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if isinstance(spec.prompt, Conversation):
        path = CHAT_PATH
        body["messages"] = spec.prompt.to_openai()
    elif isinstance(spec.prompt, str) and options.chat:
        path = CHAT_PATH
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        path = COMPLETIONS_PATH
        body["prompt"] = spec.prompt if isinstance(spec.prompt, str) else list(spec.prompt)
    # ignore_eos and cache_salt are vLLM's extensions (specpage's front names them alike):
    # sent only when they change something, so a server without them still serves.
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.cache_salt:
        body["cache_salt"] = options.cache_salt
    if options.request_seeds:
        body["seed"] = spec.seed
    if options.temperature is not None:
        body["temperature"] = options.temperature
    body.update(spec.sampling)  # a trace line's own settings win; its keys are vLLM's names
    return path, body


class OpenAIClient:
    """Streams requests to one OpenAI-compatible server and fills in their records
    (a Backend). `connections` bounds the pool: as many as requests may be in flight,
    so that no request waits for a connection unseen."""

    def __init__(
        self, target: TargetOptions, options: RequestOptions, run_tag: str, connections: int
    ) -> None:
        self.target = target
        self.options = options
        self.run_tag = run_tag
        self.model = target.model or ""  # found by connect() when not given
        self.endpoints: Counter[str] = Counter()  # requests sent, by path
        headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        # No httpx timeouts: a request's whole life is bounded by request_timeout_s instead,
        # as a gRPC deadline bounds it, however slowly its tokens trickle in.
        self._http = httpx.AsyncClient(
            base_url=target.address, headers=headers, limits=limits, timeout=None,
            verify=_verify(target),
        )

    async def close(self) -> None:
        await self._http.aclose()

    def describe(self) -> dict[str, Any]:
        return {"api": "openai", "address": self.target.address, "model": self.model,
                "endpoints": dict(sorted(self.endpoints.items()))}

    def new_record(self, spec: RequestSpec) -> RequestRecord:
        return new_record(spec, self.run_tag)

    async def connect(self, health_timeout_s: float) -> None:
        if health_timeout_s > 0:
            await self.wait_healthy(health_timeout_s)
        if not self.model:
            self.model = await self._first_model()

    async def wait_healthy(self, timeout_s: float) -> None:
        """Poll GET /health (or /v1/models where there is no /health) until 200."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        path = HEALTH_PATH
        while True:
            try:
                reply = await self._http.get(path, timeout=PROBE_TIMEOUT_S)
                if reply.status_code == httpx.codes.OK:
                    return
                if reply.status_code == httpx.codes.NOT_FOUND and path == HEALTH_PATH:
                    path = MODELS_PATH
                    continue
                last = f"{path}: HTTP {reply.status_code} {_message(reply.content)}"
            except httpx.TransportError as error:
                last = f"{path}: {type(error).__name__}: {error}"
            if loop.time() >= deadline:
                raise TargetError(
                    f"{self.target.address} is not serving after {timeout_s:g}s ({last})"
                )
            await asyncio.sleep(HEALTH_POLL_S)

    async def _first_model(self) -> str:
        """The first model GET /v1/models lists. The server has answered its
        health check by now, so this is a request like the run's, bounded by
        the request timeout (a probe's second fails it on a busy machine)."""
        try:
            reply = await self._http.get(MODELS_PATH, timeout=self.target.request_timeout_s)
        except httpx.TransportError as error:
            raise TargetError(f"{self.target.address}{MODELS_PATH}: "
                              f"{type(error).__name__}: {error}") from None
        if reply.status_code != httpx.codes.OK:
            raise TargetError(f"{self.target.address}{MODELS_PATH}: HTTP {reply.status_code} "
                              f"{_message(reply.content)}; name the model with --model")
        try:
            return str(reply.json()["data"][0]["id"])
        except (ValueError, LookupError, TypeError):
            raise TargetError(f"{self.target.address}{MODELS_PATH} lists no model id; "
                              "name the model with --model") from None

    async def generate(
        self, spec: RequestSpec, record: RequestRecord, clock: Callable[[], float]
    ) -> None:
        """Send one request and record its stream; returns when the stream has ended."""
        path, body = build_body(spec, self.options, self.model)
        self.endpoints[path] += 1
        record.sent_s = clock()
        # The stream runs as a task of its own, so a planned cancellation can cancel it
        # (closing the connection, which is how an HTTP client cancels) and only it.
        stream = asyncio.create_task(self._stream(path, body, record, clock))
        timer = None
        if spec.cancel_after_s is not None:
            timer = asyncio.get_running_loop().call_later(
                spec.cancel_after_s, _cancel, stream, record
            )
        try:
            await stream
            record.status, record.outcome = "OK", "completed"
        except asyncio.CancelledError:
            record.end_s = clock()
            current = asyncio.current_task()
            if record.outcome != "cancelled" or (current is not None and current.cancelling()):
                raise  # not our planned cancel: the run itself is being torn down
        except StreamError as error:
            record.end_s = clock()
            record.status, record.outcome, record.error = error.status, "error", str(error)
        finally:
            if timer is not None:
                timer.cancel()
            if not stream.done():
                stream.cancel()
        record.end_s = record.end_s if record.end_s is not None else clock()

    async def _stream(
        self, path: str, body: dict[str, Any], record: RequestRecord, clock: Callable[[], float]
    ) -> None:
        headers = {"X-Request-Id": record.request_id}
        try:
            async with asyncio.timeout(self.target.request_timeout_s):
                async with self._http.stream("POST", path, json=body, headers=headers) as reply:
                    if reply.status_code != httpx.codes.OK:
                        record.retry_after_ms = _retry_after_ms(reply.headers)
                        raise StreamError(_status_name(reply.status_code),
                                          _message(await reply.aread()))
                    await _read_events(reply, path == CHAT_PATH, record, clock)
            record.end_s = clock()
        except TimeoutError:
            limit = self.target.request_timeout_s
            raise StreamError("DEADLINE_EXCEEDED",
                              f"no end after {limit:g}s (--request-timeout)") from None
        except httpx.TransportError as error:
            raise StreamError("UNAVAILABLE", f"{type(error).__name__}: {error}") from None


async def _read_events(
    reply: httpx.Response, chat: bool, record: RequestRecord, clock: Callable[[], float]
) -> None:
    """Map each chunk to the record: new tokens of choice 0 as a chunk, the usage at the end."""
    async for data in event_data(reply.aiter_lines()):
        now = clock()
        if data == DONE:
            _settle_counts(record)
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise StreamError("INTERNAL", f"a stream chunk is not JSON: {data[:200]!r}") from None
        if "error" in chunk:  # an error after the 200: vLLM sends it as a chunk
            raise StreamError("INTERNAL", _message(data.encode()))
        usage = chunk.get("usage")
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0 or _announces_role(choice, chat):
                continue
            # A chunk brings tokens even without text: a server without a tokenizer, or
            # one holding back part of a character, streams them with empty text.
            if usage:  # vLLM's continuous_usage_stats: the count so far, as gRPC's num_tokens
                record.add_chunk(now, int(usage.get("completion_tokens") or 0))
            else:  # otherwise each chunk is a token until the usage says more
                record.add_chunk(now, record.num_tokens + 1)
            record.finish_reason = choice.get("finish_reason") or record.finish_reason
        if usage and not chunk.get("choices"):
            _record_usage(record, usage)
    raise StreamError("INTERNAL", f"stream ended without data: {DONE}")


def _announces_role(choice: dict[str, Any], chat: bool) -> bool:
    """The chat stream's opening chunk names the role and carries no token."""
    delta = choice.get("delta") or {}
    return chat and "role" in delta and not delta.get("content")


def _record_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.prompt_tokens = usage.get("prompt_tokens")
    record.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens")


def _settle_counts(record: RequestRecord) -> None:
    """The usage's completion_tokens is the count. A server that streams several tokens
    in a chunk without saying how many has them spread evenly over its chunks: TPOT
    stays exact, and each inter-token latency is its chunk's gap shared by its tokens."""
    total, chunks, counted = record.completion_tokens, record.chunks, record.num_tokens
    if total is None or not chunks or total == counted:
        return
    settled: list[tuple[float, int]] = []
    for now, count in chunks[:-1]:
        scaled = min(total - 1, max(1, round(count * total / counted)))
        # (a total of 1 leaves no room before the last chunk: scaled is 0 and dropped)
        if scaled > (settled[-1][1] if settled else 0):
            settled.append((now, scaled))
    record.chunks = [*settled, (chunks[-1][0], total)]
    record.num_tokens = total


def _status_name(code: int) -> str:
    return HTTP_STATUS_NAMES.get(code, f"HTTP_{code}")


def _message(body: bytes) -> str:
    """The OpenAI error object's message (vLLM's older flat form too), else the body."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500]
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(error)[:500]


def _retry_after_ms(headers: httpx.Headers) -> int | None:
    for name, scale in (("retry-after-ms", 1), ("retry-after", MS_PER_S)):
        try:
            return round(float(headers[name]) * scale)
        except (KeyError, ValueError):
            continue
    return None


def _cancel(stream: asyncio.Task[None], record: RequestRecord) -> None:
    # Only a cancel that takes effect counts: a finished stream stays completed.
    if not stream.done():
        stream.cancel()
        record.outcome, record.status = "cancelled", "CANCELLED"


def _verify(target: TargetOptions) -> ssl.SSLContext | bool:
    if target.tls_ca_pem is None:
        return True  # the system's roots, for https:// targets
    return ssl.create_default_context(cadata=target.tls_ca_pem.decode("ascii"))
