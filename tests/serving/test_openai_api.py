"""The OpenAI-compatible HTTP API on a real daemon: the official `openai` SDK gets
the same greedy tokens as gRPC, chats render through the chat template as
transformers does, SSE is framed as OpenAI's, and every bad request gets its
status and an error object naming the parameter while other streams go on."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from specpage.client import Client
from specpage.core.request import SamplingParams
from specpage.engine import Engine, EngineConfig
from specpage.engine.builder import load_tokenizer
from specpage.engine.submission import ChatPrompt, Preparer, RequestOptions
from specpage.models.loader import load_model
from tests.support.checkpoints import tokenizer_pair
from tests.support.daemon import Daemon, http_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = [5, 6, 7, 8]
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0.0}
NO_EOS = {"ignore_eos": True}
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("openai")
    tokenizer_pair(folder / "models")
    return folder


@pytest.fixture(scope="module")
def daemon(models: Path) -> Iterator[Daemon]:
    yield from http_daemon(models)


def sdk(daemon: Daemon, **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused",
                              max_retries=0, timeout=TIMEOUT_S, **options)


def model_name(daemon: Daemon) -> str:
    return str(daemon.config.read_text().split('target = "')[1].split('"')[0])


async def sse(response: httpx.Response) -> AsyncIterator[str]:
    """The data of each event, checking the framing: `data: ...` then a blank line."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            assert event.startswith("data: "), event
            yield event.removeprefix("data: ")
    assert buffer == ""


async def grpc_greedy(daemon: Daemon, prompt: str | list[int], chat: bool,
                      max_tokens: int) -> tuple[list[int], list[float]]:
    async with Client(daemon.address, max_retries=0) as client:
        completion = await client.complete(prompt, chat=chat, max_tokens=max_tokens,
                                           temperature=0.0, ignore_eos=True, logprobs=True)
    return completion.token_ids, completion.samples[0].logprobs


# ---------------------------------------------------------------- the SDK, gRPC's tokens


async def test_sdk_chat_gets_grpc_greedy_tokens_streamed_or_not(daemon: Daemon) -> None:
    tokenizer = load_tokenizer(daemon.config.parent / "models" / "target")
    token_ids, logprobs = await grpc_greedy(daemon, "Hello there", True, 6)
    expected = [tokenizer.decode([t]) for t in token_ids]
    async with sdk(daemon) as client:
        reply = await client.chat.completions.create(
            model=model_name(daemon), messages=[{"role": "user", "content": "Hello there"}],
            logprobs=True, extra_body=NO_EOS, **GREEDY)
        choice = reply.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert [p.token for p in choice.logprobs.content] == expected
        assert [p.logprob for p in choice.logprobs.content] == pytest.approx(logprobs, abs=1e-6)
        assert choice.message.content == tokenizer.decode(token_ids)
        assert choice.message.role == "assistant" and choice.finish_reason == "length"
        assert reply.object == "chat.completion" and reply.model == model_name(daemon)
        assert reply.usage is not None and reply.usage.completion_tokens == 6
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6

        stream = await client.chat.completions.create(
            model=model_name(daemon), messages=[{"role": "user", "content": "Hello there"}],
            logprobs=True, stream=True, stream_options={"include_usage": True},
            extra_body=NO_EOS, **GREEDY)
        tokens: list[str] = []
        text, usage, reasons = "", None, []
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if chunk.usage is not None:
                usage = chunk.usage
                assert chunk.choices == []
                continue
            delta = chunk.choices[0]
            text += delta.delta.content or ""
            if delta.logprobs is not None and delta.logprobs.content:
                tokens += [p.token for p in delta.logprobs.content]
            reasons.append(delta.finish_reason)
        assert tokens == expected and text == choice.message.content
        # only the last chunk ends the choice (speculation may bring all six
        # tokens in one step, so there may be no chunk before it)
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
        # the same but for what speculation drafted: the suffix cache holds the
        # first reply's text by now
        assert usage is not None
        assert usage.model_dump(exclude={"speculation"}) == reply.usage.model_dump(
            exclude={"speculation"})


async def test_sdk_completions_get_grpc_greedy_tokens_streamed_or_not(daemon: Daemon) -> None:
    tokenizer = load_tokenizer(daemon.config.parent / "models" / "target")
    token_ids, logprobs = await grpc_greedy(daemon, PROMPT, False, 8)
    async with sdk(daemon) as client:
        reply = await client.completions.create(
            model=model_name(daemon), prompt=PROMPT, logprobs=0, max_tokens=8, temperature=0.0,
            extra_body=NO_EOS)
        choice = reply.choices[0]
        assert choice.text == tokenizer.decode(token_ids)
        assert choice.logprobs is not None
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in token_ids]
        assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-6)
        assert reply.object == "text_completion"
        assert reply.usage is not None
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (4, 8)
        # the same prompt as text: the same tokens
        text_reply = await client.completions.create(
            model=model_name(daemon), prompt=tokenizer.decode(PROMPT), max_tokens=8,
            temperature=0.0, extra_body=NO_EOS)
        assert text_reply.choices[0].text == choice.text

        stream = await client.completions.create(
            model=model_name(daemon), prompt=PROMPT, max_tokens=8, temperature=0.0,
            stream=True, extra_body=NO_EOS)
        text = "".join([chunk.choices[0].text async for chunk in stream])
        assert text == choice.text


async def test_usage_counts_cached_prompt_tokens_and_speculation(daemon: Daemon) -> None:
    prompt = list(range(100, 140))  # 10 full blocks of 4
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        first = (await http.post("/v1/completions", json=body)).json()["usage"]
        second = (await http.post("/v1/completions", json=body)).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    # all but the last block: its last token is computed again for its logits
    assert second["prompt_tokens_details"] == {"cached_tokens": 36}
    for usage in (first, second):
        assert usage["prompt_tokens"] == 40 and usage["completion_tokens"] == 4
        assert usage["total_tokens"] == 44
        spec = usage["speculation"]
        assert set(spec) == {"drafted_tokens", "accepted_tokens", "by_method"}
        assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
        by_method = spec["by_method"].values()
        assert sum(m["drafted_tokens"] for m in by_method) == spec["drafted_tokens"]
        assert sum(m["accepted_tokens"] for m in by_method) == spec["accepted_tokens"]


# ---------------------------------------------------------------- chat template


async def test_a_conversation_renders_as_transformers_apply_chat_template(models: Path) -> None:
    folder = models / "models" / "target"
    expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        CONVERSATION, add_generation_prompt=True, return_dict=True)["input_ids"]
    engine = Engine(load_model(folder), None, load_tokenizer(folder),
                    EngineConfig(block_size=4, num_blocks=64))
    made = Preparer(engine, max_prompt_tokens=400).make_request(
        ChatPrompt(CONVERSATION), SamplingParams(), RequestOptions("chat", 0.0))
    assert list(made.prompt_token_ids) == list(expected)


async def test_a_conversation_over_http_is_the_templated_prompt(daemon: Daemon) -> None:
    tokenizer = AutoTokenizer.from_pretrained(daemon.config.parent / "models" / "target")
    ids = list(tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, return_dict=True)["input_ids"])
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        chat = (await http.post("/v1/chat/completions", json={
            "messages": CONVERSATION, "logprobs": True, **GREEDY, **NO_EOS})).json()
        plain = (await http.post("/v1/completions", json={
            "prompt": ids, "logprobs": 0, **GREEDY, **NO_EOS})).json()
    assert chat["usage"]["prompt_tokens"] == len(ids) == plain["usage"]["prompt_tokens"]
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    assert [p["logprob"] for p in chat["choices"][0]["logprobs"]["content"]] == pytest.approx(
        plain["choices"][0]["logprobs"]["token_logprobs"], abs=1e-6)


# ---------------------------------------------------------------- SSE framing


async def test_sse_framing_with_n_choices_and_usage(daemon: Daemon) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 5, "temperature": 0.8,
            "seed": 7, **NO_EOS}
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [data async for data in sse(response)]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(data) for data in events[:-1]]
    *choices, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    ids = {chunk["id"] for chunk in chunks}
    assert len(ids) == 1 and ids.pop() == "chatcmpl-" + response.headers["x-request-id"]
    for index in (0, 1):
        mine = [c["choices"][0] for c in choices if c["choices"][0]["index"] == index]
        # the role comes with the choice's first text, not in a chunk of its own
        assert mine[0]["delta"] == {"role": "assistant", "content": mine[0]["delta"]["content"]}
        assert isinstance(mine[0]["delta"]["content"], str)
        assert all("role" not in c["delta"] for c in mine[1:])
        assert [c["finish_reason"] for c in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == "length"
    assert all("usage" not in chunk for chunk in choices)


async def test_sse_without_usage_ends_with_done(daemon: Daemon) -> None:
    body = {"prompt": "Hello", "stream": True, "max_tokens": 3, "temperature": 0.0, **NO_EOS}
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        events = [data async for data in sse(response)]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(data) for data in events[:-1]]
    assert all(chunk["object"] == "text_completion" and "usage" not in chunk
               for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- routes


async def test_models_health_and_metrics(daemon: Daemon) -> None:
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        models = (await http.get("/v1/models")).json()
        assert [card["id"] for card in models["data"]] == [model_name(daemon)]
        card = models["data"][0]
        assert card["object"] == "model" and card["max_model_len"] == 512
        assert card["metadata"]["draft"].endswith("/draft")
        assert (await http.get("/health")).status_code == 200
        metrics = await http.get("/metrics")
        assert metrics.status_code == 200
        assert 'specpage_kv_blocks{state="free"}' in metrics.text
    async with sdk(daemon) as client:
        listed = await client.models.list()
        assert [model.id for model in listed.data] == [model_name(daemon)]
