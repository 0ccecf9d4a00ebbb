"""Errors of the HTTP API on a real daemon: each bad request gets its status and
OpenAI's error object naming the parameter while a stream in flight goes on;
a client that disconnects frees its blocks; a full queue is 429 with
Retry-After; the bearer token guards every path but /health."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specpage.client import Client
from tests.serving.test_openai_api import NO_EOS, TIMEOUT_S, sse
from tests.support.checkpoints import tokenizer_pair
from tests.support.daemon import Daemon, http_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 400, "temperature": 0.0, **NO_EOS}
DRAIN_GRACE_S = 600  # the drain ends when its streams do, long before this
HEALTH_TIMEOUT_S = 60.0  # for /health to answer 503 after SIGTERM


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("openai-errors")
    tokenizer_pair(folder / "models")
    return folder


@pytest.fixture(scope="module")
def daemon(models: Path) -> Iterator[Daemon]:
    yield from http_daemon(models, gate=True)


async def pool_idle(daemon: Daemon) -> None:
    """Until nothing runs and every block is free or cached (at most 30 s)."""
    async with Client(daemon.address, max_retries=0) as client:
        for _ in range(600):
            info = await client.server_info()
            if info.running == info.waiting == info.pool.in_use == 0:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"still busy: {info}")


BAD: list[tuple[str, str, dict[str, Any], int, str | None]] = [
    # (name, path, body, status, param)
    ("unknown field", "/v1/chat/completions", {**CHAT, "frobnicate": 1}, 400, "frobnicate"),
    ("wrong type", "/v1/chat/completions", {**CHAT, "max_tokens": "3"}, 400, "max_tokens"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    ("image part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("presence penalty", "/v1/chat/completions", {**CHAT, "presence_penalty": 2.5}, 400,
     "presence_penalty"),
    ("logit bias", "/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101.0}}, 400,
     "logit_bias"),
    ("top logprobs", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("top logprobs unasked", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("a response format not offered", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("logit bias key", "/v1/chat/completions", {**CHAT, "logit_bias": {"five": 1.0}}, 400,
     "logit_bias"),
    ("min tokens", "/v1/chat/completions", {**CHAT, "min_tokens": -1}, 400, "min_tokens"),
    ("repetition penalty", "/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("stream options unstreamed", "/v1/chat/completions",
     {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("max tokens 0", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("max completion tokens 0", "/v1/chat/completions",
     {**CHAT, "max_tokens": None, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("temperature", "/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("top p", "/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("n", "/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("seed", "/v1/chat/completions", {**CHAT, "seed": -2}, 400, "seed"),
    ("empty stop", "/v1/chat/completions", {**CHAT, "stop": [""]}, 400, "stop"),
    ("long salt", "/v1/chat/completions", {**CHAT, "cache_salt": "s" * 257}, 400,
     "cache_salt"),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "model"),
    ("token out of vocabulary", "/v1/completions", {"prompt": [49152]}, 400, "prompt"),
    ("prompt too long", "/v1/completions", {"prompt": [5] * 600}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty batch", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("empty prompt in a batch", "/v1/completions", {"prompt": ["a", ""]}, 400, "prompt[1]"),
    ("mixed batch", "/v1/completions", {"prompt": ["a", [5]]}, 400, "prompt"),
    ("top alternatives", "/v1/completions", {"prompt": "a", "logprobs": 6}, 400, "logprobs"),
    ("echo in chat", "/v1/chat/completions", {**CHAT, "echo": True}, 400, "echo"),
    ("prompt logprobs", "/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, 400,
     "prompt_logprobs"),
    ("not JSON", "/v1/completions", "{", 400, "body"),
]


async def test_each_bad_request_gets_its_status_naming_the_parameter(daemon: Daemon) -> None:
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http, \
            http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
        events = sse(running)
        first = json.loads(await anext(events))
        for name, path, body, status, param in BAD:
            if isinstance(body, str):
                reply = await http.post(path, content=body)
            else:
                reply = await http.post(path, json=body)
            assert reply.status_code == status, (name, reply.text)
            error = reply.json()["error"]
            assert error["param"] == param, (name, error)
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error", name
        # the stream in flight all along is not disturbed
        rest = [data async for data in events]
    assert rest[-1] == "[DONE]"
    texts = [first] + [json.loads(data) for data in rest[:-1]]
    assert texts[-1]["choices"][0]["finish_reason"] == "length"
    await pool_idle(daemon)


async def aborts(http: httpx.AsyncClient) -> float:
    """specpage_request_aborts_total, from /metrics on the HTTP port."""
    text = (await http.get("/metrics")).text
    line = next(line for line in text.splitlines()
                if line.startswith("specpage_request_aborts_total"))
    return float(line.split()[-1])


async def test_not_found_and_method_not_allowed_are_error_objects(daemon: Daemon) -> None:
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        missing = await http.get("/v1/embeddings")
        wrong = await http.get("/v1/chat/completions")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == (
        "invalid_request_error")
    assert wrong.status_code == 405 and "error" in wrong.json()


async def test_a_client_disconnecting_mid_stream_frees_its_blocks(daemon: Daemon) -> None:
    """The step gate holds each request after its first step: it cannot run
    its 400 tokens to the end before its client leaves."""
    gate = daemon.gate
    assert gate is not None
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        before = await aborts(http)
        for path, body in (("/v1/completions", {**LONG, "stream": True}),
                           ("/v1/chat/completions", {**CHAT, **NO_EOS, "max_tokens": 400,
                                                     "stream": True, "n": 2})):
            gate.close()
            try:
                async with http.stream("POST", path, json=body) as response:
                    events = sse(response)
                    first = asyncio.ensure_future(anext(events))
                    await gate.wait_held()
                    gate.allow()  # the prefill: the first token, the first event
                    assert '"error"' not in await first
                    async with Client(daemon.address, max_retries=0) as client:
                        info = await client.server_info()
                        assert info.running > 0 and info.pool.in_use > 0
            finally:
                gate.open()
            # the response is closed: the request is aborted at the next step
            await pool_idle(daemon)
        # a non-streamed request whose client leaves is aborted too
        gate.close()
        try:
            task = asyncio.ensure_future(http.post("/v1/completions", json=LONG))
            await gate.wait_held()
            await gate.step()  # it runs
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            gate.open()
        await pool_idle(daemon)
        # each was aborted, none ran its 400 tokens to the end
        assert await aborts(http) == before + 3


async def test_a_full_queue_is_429_with_retry_after(models: Path) -> None:
    daemon = Daemon(models, engine="max_num_seqs = 1", server="max_queue = 2", http=True,
                    gate=True)
    daemon.wait_serving()
    gate = daemon.gate
    assert gate is not None
    try:
        async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
            gate.close()  # none of them can finish: each step waits for the test
            tasks = [asyncio.ensure_future(http.post("/v1/completions", json={
                **LONG, "prompt": [5, 6, 7, i]})) for i in range(3)]
            await gate.wait_admitted(3)
            await gate.wait_held()
            for _ in range(2):  # a step takes what was admitted, the next schedules it all
                await gate.step()
            async with Client(daemon.address, max_retries=0) as client:
                info = await client.server_info()
                assert (info.running, info.waiting) == (1, 2)
            reply = await http.post("/v1/completions", json=LONG)
            assert reply.status_code == 429
            assert int(reply.headers["retry-after"]) >= 1
            assert reply.json()["error"]["code"] == "queue_full"
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        gate.open()
        assert daemon.stop() == 0


async def test_bearer_token_guards_all_but_health(models: Path) -> None:
    daemon = Daemon(models, server='bearer_token = "s3cret"', http=True)
    daemon.wait_serving()
    try:
        async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
            assert (await http.get("/health")).status_code == 200
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                for path in ("/v1/models", "/v1/completions"):
                    reply = await http.request("POST" if "compl" in path else "GET", path,
                                               json={"prompt": "a"}, headers=headers)
                    assert reply.status_code == 401
                    assert reply.json()["error"]["code"] == "invalid_api_key"
            ok = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2},
                                 headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200
    finally:
        assert daemon.stop() == 0


async def test_drain_finishes_http_streams_and_refuses_new_requests(models: Path) -> None:
    daemon = Daemon(models, server=f"drain_grace_s = {DRAIN_GRACE_S}", http=True, gate=True)
    daemon.wait_serving()
    gate = daemon.gate
    assert gate is not None
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        async def stream(i: int) -> list[str]:
            body = {**LONG, "prompt": [5, 6, 7, i], "max_tokens": 300, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                return [data async for data in sse(response)]

        gate.close()  # the streams are in flight until the test lets them go on
        try:
            streams = [asyncio.ensure_future(stream(i)) for i in range(2)]
            await gate.wait_admitted(2)
            await gate.wait_held()
            async with Client(daemon.address, max_retries=0) as client:
                while (await client.server_info()).running < 2:  # two steps at most
                    await gate.step()
            daemon.terminate()
            health = await http.get("/health")
            end = time.monotonic() + HEALTH_TIMEOUT_S  # SIGTERM is handled on its own time
            while health.status_code == 200 and time.monotonic() < end:
                await asyncio.sleep(0.02)
                health = await http.get("/health")
            assert health.status_code == 503
            refused = await http.post("/v1/completions", json={"prompt": "a"})
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "service_unavailable_error"
        finally:
            gate.open()
        for events in await asyncio.gather(*streams):
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 300
    assert daemon.stop() == 0
