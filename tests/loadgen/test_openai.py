"""loadgen's OpenAI-compatible backend.

Against a replay server (Starlette on uvicorn at 127.0.0.1:0, on the test's event
loop) that answers each request with recorded SSE bytes: how chunks map to the
record, tokens taken from the usage, errors and their statuses, cancellation
closing the connection. Against a real daemon's HTTP front: a short run counts
every request and its tokens from the usage, and the same run over gRPC gives
the same token counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadgen.backend import RequestOptions, TargetError, TargetOptions
from loadgen.cli import main
from loadgen.openai_client import OpenAIClient, build_body
from loadgen.record import RequestRecord
from loadgen.sse import event_data
from loadgen.workload import RequestSpec
from tests.support.daemon import Daemon

MODEL = "replayed-model"
CONNECTIONS = 8
CANCEL_AFTER_S = 0.1
SLOW_GAP_S = 60.0  # a replayed stream that would outlast any cancel by far
NEVER_S = 600.0  # a planned cancel that a finished stream never meets
HANG_GUARD_S = 60.0  # a wait for what must happen: a bound on a hang, not on the speed


def completion_chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def chat_chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def usage_chunk(prompt: int, completion: int, cached: int | None = None) -> dict:
    usage: dict = {"prompt_tokens": prompt, "completion_tokens": completion,
                   "total_tokens": prompt + completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [],
            "usage": usage}


def sse(*events: dict | str) -> list[bytes]:
    """Each event as the server frames it: `data: ...` and a blank line."""
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events]


@dataclass(frozen=True)
class Reply:
    pieces: list[bytes] = field(default_factory=list)  # streamed with gap_s between them
    gap_s: float = 0.0
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class ReplayServer:
    """Answers request i (the index ending its X-Request-Id) with replies[i]."""

    replies: dict[int, Reply]
    health_status: int = 200
    bodies: dict[int, dict] = field(default_factory=dict)
    paths: dict[int, str] = field(default_factory=dict)
    closed_early: list[int] = field(default_factory=list)  # streams the client closed
    pieces_sent: dict[int, int] = field(default_factory=dict)  # written before the stream ended

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", self.health),
            Route("/v1/models", self.models),
            Route("/v1/completions", self.complete, methods=["POST"]),
            Route("/v1/chat/completions", self.complete, methods=["POST"]),
        ])

    async def health(self, request: Request) -> Response:
        return Response(status_code=self.health_status)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def complete(self, request: Request) -> Response:
        index = int(request.headers["x-request-id"].rsplit("-", 1)[1])
        self.bodies[index] = await request.json()
        self.paths[index] = request.url.path
        reply = self.replies[index]
        if reply.status != 200:
            return Response(b"".join(reply.pieces), reply.status, reply.headers,
                            media_type="application/json")
        return StreamingResponse(self._stream(index, reply), media_type="text/event-stream")

    async def _stream(self, index: int, reply: Reply) -> AsyncIterator[bytes]:
        sent = 0
        try:
            for piece in reply.pieces:
                if sent:
                    await asyncio.sleep(reply.gap_s)
                yield piece
                sent += 1
        finally:
            self.pieces_sent[index] = sent
            if sent < len(reply.pieces):
                self.closed_early.append(index)


async def serve(replay: ReplayServer) -> tuple[uvicorn.Server, asyncio.Task, str]:
    config = uvicorn.Config(replay.app(), host="127.0.0.1", port=0, log_level="warning",
                            lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), task.exception()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, task, f"http://127.0.0.1:{port}"


async def run_specs(
    replay: ReplayServer, specs: list[RequestSpec], options: RequestOptions | None = None,
    model: str | None = None,
) -> tuple[list[RequestRecord], OpenAIClient]:
    server, task, url = await serve(replay)
    target = TargetOptions(url, api="openai", model=model, request_timeout_s=30.0)
    client = OpenAIClient(target, options or RequestOptions(), "t", CONNECTIONS)
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        await client.connect(health_timeout_s=HANG_GUARD_S)
        records = [client.new_record(spec) for spec in specs]
        await asyncio.gather(*(client.generate(spec, record, lambda: loop.time() - start)
                               for spec, record in zip(specs, records, strict=True)))
    finally:
        await client.close()
        server.should_exit = True
        await task
    return records, client


def spec(index: int, prompt: tuple[int, ...] | str = (5, 6, 7), max_tokens: int = 6,
         cancel_after_s: float | None = None) -> RequestSpec:
    return RequestSpec(index, False, 0.0, prompt, max_tokens, seed=1234 + index,
                       cancel_after_s=cancel_after_s)


# ---------------------------------------------------------------- request bodies


def test_token_prompts_go_to_completions_with_the_run_salt_and_no_seed():
    options = RequestOptions(cache_salt="loadgen-00ff")
    path, body = build_body(spec(0), options, MODEL)
    assert path == "/v1/completions"
    assert body == {
        "model": MODEL, "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}, "prompt": [5, 6, 7],
        "ignore_eos": True, "cache_salt": "loadgen-00ff",
    }


def test_chat_text_prompts_go_to_chat_as_one_user_message():
    options = RequestOptions(chat=True, ignore_eos=False, request_seeds=True, temperature=0.0)
    path, body = build_body(spec(2, prompt="tell me"), options, MODEL)
    assert path == "/v1/chat/completions"
    assert body == {
        "model": MODEL, "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "tell me"}], "seed": 1236, "temperature": 0.0,
    }
    # Without --chat a text prompt is sent as it is; token ids never go to chat.
    assert build_body(spec(2, prompt="tell me"), RequestOptions(), MODEL)[1]["prompt"] == "tell me"
    assert build_body(spec(2), options, MODEL)[0] == "/v1/completions"


# ---------------------------------------------------------------- SSE framing


async def lines(*items: str) -> AsyncIterator[str]:
    for item in items:
        yield item


@pytest.mark.asyncio
async def test_sse_events_join_data_lines_skip_comments_and_drop_an_unfinished_event():
    stream = lines(": keep-alive", "", "data: {\"a\": 1}", "", "data:x", "data: y", "",
                   "event: ignored", "id: 3", "data: [DONE]", "", "data: cut")
    assert [data async for data in event_data(stream)] == ['{"a": 1}', "x\ny", "[DONE]"]


# ---------------------------------------------------------------- streams


@pytest.mark.asyncio
async def test_completion_chunks_become_record_chunks_counted_by_the_usage():
    # Three chunks carrying 2 tokens each (as a speculating server streams them), then
    # the usage: the record has 6 tokens, spread evenly over the chunks' arrivals.
    pieces = sse(completion_chunk("ab"), completion_chunk("cd"),
                 completion_chunk("ef", "length"), usage_chunk(3, 6, cached=2), "[DONE]")
    replay = ReplayServer({0: Reply(pieces, gap_s=0.05)})
    [record], client = await run_specs(replay, [spec(0)])
    assert (record.outcome, record.status, record.error) == ("completed", "OK", "")
    assert record.finish_reason == "length"
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (3, 6, 2)
    assert record.num_tokens == 6 and [count for _, count in record.chunks] == [2, 4, 6]
    assert record.first_token_s == record.chunks[0][0]
    assert record.last_token_s == record.chunks[-1][0]
    assert len(record.itl_s()) == 5
    assert client.model == MODEL  # asked GET /v1/models
    assert replay.bodies[0]["model"] == MODEL and replay.paths[0] == "/v1/completions"
    assert client.describe() == {"api": "openai", "address": client.target.address,
                                 "model": MODEL, "endpoints": {"/v1/completions": 1}}


@pytest.mark.asyncio
async def test_chat_role_chunk_is_no_token_and_continuous_usage_counts_each_chunk():
    # vLLM's continuous_usage_stats puts the count so far in every chunk: it is exact.
    role = chat_chunk({"role": "assistant", "content": ""})
    counted = [chat_chunk({"content": text}) | {"usage": {"completion_tokens": n}}
               for text, n in (("a", 1), ("bcd", 4), ("e", 5))]
    pieces = sse(role, *counted, usage_chunk(7, 5), "[DONE]")
    replay = ReplayServer({1: Reply(pieces, gap_s=0.02)})
    options = RequestOptions(chat=True)
    [record], _ = await run_specs(replay, [spec(1, prompt="hi there")], options, model="m")
    assert record.outcome == "completed" and replay.bodies[1]["model"] == "m"
    assert [count for _, count in record.chunks] == [1, 4, 5] and record.num_tokens == 5
    assert replay.paths[1] == "/v1/chat/completions"


@pytest.mark.asyncio
async def test_chunks_without_text_still_bring_tokens():
    # A server without a tokenizer streams its tokens with empty text (chat: empty delta).
    pieces = sse(chat_chunk({"role": "assistant", "content": ""}), chat_chunk({}),
                 chat_chunk({}, "length"), usage_chunk(3, 4), "[DONE]")
    replay = ReplayServer({0: Reply(pieces, gap_s=0.02)})
    [record], _ = await run_specs(replay, [spec(0, prompt="hi")], RequestOptions(chat=True))
    assert [count for _, count in record.chunks] == [2, 4] and record.num_tokens == 4


@pytest.mark.asyncio
async def test_one_token_in_two_text_chunks_keeps_one_chunk():
    pieces = sse(completion_chunk("a"), completion_chunk("!", "length"),
                 usage_chunk(3, 1), "[DONE]")
    [record], _ = await run_specs(ReplayServer({0: Reply(pieces)}), [spec(0, max_tokens=1)])
    assert [count for _, count in record.chunks] == [1] and record.num_tokens == 1


# ---------------------------------------------------------------- errors


def error_body(message: str, param: str | None = None) -> list[bytes]:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param,
                      "code": None}}
    return [json.dumps(body).encode()]


@pytest.mark.asyncio
async def test_http_errors_are_counted_under_the_grpc_status_names():
    replies = {
        0: Reply(error_body("the admission queue is full"), status=429,
                 headers={"Retry-After": "2"}),
        1: Reply(error_body("draining"), status=503),
        2: Reply(error_body("max_tokens must be >= 1", "max_tokens"), status=400),
        3: Reply(sse(completion_chunk("a"), {"error": {"message": "engine fault"}})),
        4: Reply(sse(completion_chunk("a"), usage_chunk(3, 1))),  # no [DONE]
        5: Reply([b"not json"], status=502),
    }
    records, _ = await run_specs(ReplayServer(replies), [spec(i) for i in range(6)])
    assert [(r.outcome, r.status, r.error) for r in records] == [
        ("error", "RESOURCE_EXHAUSTED", "the admission queue is full"),
        ("error", "UNAVAILABLE", "draining"),
        ("error", "INVALID_ARGUMENT", "max_tokens must be >= 1"),
        ("error", "INTERNAL", "engine fault"),
        ("error", "INTERNAL", "stream ended without data: [DONE]"),
        ("error", "HTTP_502", "not json"),
    ]
    assert records[0].retry_after_ms == 2000
    assert [r.retry_after_ms for r in records[1:]] == [None] * 5
    assert records[3].num_tokens == 1 and all(r.end_s is not None for r in records)


@pytest.mark.asyncio
async def test_a_planned_cancel_closes_the_stream():
    pieces = sse(completion_chunk("a"), completion_chunk("b"), usage_chunk(3, 2), "[DONE]")
    replies = {0: Reply(pieces, gap_s=SLOW_GAP_S), 1: Reply(pieces)}
    specs = [spec(0, cancel_after_s=CANCEL_AFTER_S), spec(1, cancel_after_s=NEVER_S)]
    replay = ReplayServer(replies)
    records, _ = await run_specs(replay, specs)
    assert [(r.outcome, r.status) for r in records] == [
        ("cancelled", "CANCELLED"), ("completed", "OK"),
    ]
    assert records[0].num_tokens == 1  # the first chunk came before the cancel
    assert records[0].end_s - records[0].sent_s < SLOW_GAP_S
    end = time.monotonic() + HANG_GUARD_S
    while not replay.closed_early and time.monotonic() < end:
        await asyncio.sleep(0.05)  # the server notices the closed connection at its next write
    assert replay.closed_early == [0]
    # the client closed the stream before the server's second piece, due SLOW_GAP_S
    # after the first: it did not wait for the stream (a piece counts once written)
    assert replay.pieces_sent[0] == 1


@pytest.mark.asyncio
async def test_a_server_without_health_is_checked_on_its_model_list():
    pieces = sse(completion_chunk("a", "length"), usage_chunk(3, 1), "[DONE]")
    replay = ReplayServer({0: Reply(pieces)}, health_status=404)
    [record], _ = await run_specs(replay, [spec(0, max_tokens=1)])
    assert record.outcome == "completed"


@pytest.mark.asyncio
async def test_health_waits_for_200_and_names_what_it_last_saw():
    replay = ReplayServer({}, health_status=503)
    server, task, url = await serve(replay)
    client = OpenAIClient(TargetOptions(url, api="openai"), RequestOptions(), "t", 1)
    try:
        with pytest.raises(TargetError, match=r"not serving after 0.3s \(/health: HTTP 503"):
            await client.connect(health_timeout_s=0.3)
    finally:
        await client.close()
        server.should_exit = True
        await task


# ---------------------------------------------------------------- a real daemon

DAEMON_REQUESTS = 8


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    process = Daemon(tmp_path_factory.mktemp("loadgen-openai"), http=True)
    process.wait_serving()
    yield process
    assert process.stop() == 0, process.log.read_text()


def loadgen_run(out: Path, *target: str) -> dict:
    code = main([
        "run", *target, "--no-progress", "--no-selfcheck", "--no-plots", "--rate", "4",
        "--requests", str(DAEMON_REQUESTS), "--warmup", "1", "--prompt-len", "uniform:4,24",
        "--output-len", "uniform:4,12", "--vocab-size", "211", "--temperature", "0",
        "--slo", "ttft=5s,tpot=1s", "--seed", "3", "--out", str(out),
    ])
    assert code == 0
    return json.loads((out / "report.json").read_text())


def test_a_run_over_http_counts_every_request_and_the_same_tokens_as_over_grpc(
    daemon, tmp_path
):
    http = loadgen_run(tmp_path / "http", "--api", "openai", "--target", daemon.http_url)
    counts = http["summary"]["counts"]
    assert (counts["measured"], counts["sent"], counts["completed"]) == (DAEMON_REQUESTS,) * 3
    assert counts["errors"] == counts["cancelled"] == counts["unsent"] == 0
    assert http["target"] == {
        "api": "openai", "address": daemon.http_url,
        "model": str(daemon.config.parent / "models" / "target"),
        "endpoints": {"/v1/completions": DAEMON_REQUESTS + 1},
    }
    records = http["records"]
    for record in records:
        # ignore_eos: exactly the asked length, counted by the server's usage
        assert record["num_tokens"] == record["max_tokens"] == record["completion_tokens"]
        assert record["prompt_tokens"] == record["prompt_len"]
        assert record["chunks"][-1][1] == record["num_tokens"]
    assert http["summary"]["latency"]["ttft_s"]["count"] == DAEMON_REQUESTS
    assert http["summary"]["latency"]["tpot_s"]["count"] == DAEMON_REQUESTS

    grpc_run = loadgen_run(tmp_path / "grpc", "--target", daemon.address)
    assert grpc_run["target"] == {"api": "grpc", "address": daemon.address}
    tokens = [(r["prompt_tokens"], r["completion_tokens"], r["cached_tokens"])
              for r in records]
    assert tokens == [(r["prompt_tokens"], r["completion_tokens"], r["cached_tokens"])
                      for r in grpc_run["records"]]
