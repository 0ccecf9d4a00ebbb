"""LangChain's ChatOpenAI against a real daemon, as users run it: pointed at the
HTTP API by base_url with the served name, greedy, it answers what the
official openai SDK gets for the same messages and fields, through invoke,
stream and batch, and its response metadata carries the chat
log-probabilities with their top alternatives."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI

from tests.serving.test_openai_api import CONVERSATION, TIMEOUT_S
from tests.support.checkpoints import tokenizer_pair
from tests.support.daemon import Daemon, http_daemon

MAX_TOKENS = 8
PROMPTS = ["Hello there", "What is the capital of France?", "Tell me a story."]
# The tiny target's greedy answer to this repeats its first tokens within
# MAX_TOKENS, so penalties that reach the engine change it.
REPEATING = [{"role": "user", "content": "Hello"}]
PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.3}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    folder = tmp_path_factory.mktemp("langchain")
    tokenizer_pair(folder / "models")
    yield from http_daemon(folder)


@pytest.fixture(scope="module")
def sdk(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def served_name(sdk: openai.OpenAI) -> str:
    """The name a user reads from /v1/models and gives LangChain."""
    return sdk.models.list().data[0].id


def chat_model(daemon: Daemon, served_name: str, **fields: Any) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused", model=served_name,
                      temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=TIMEOUT_S,
                      **fields)


def sdk_answer(sdk: openai.OpenAI, served_name: str, messages: list[Any],
               **fields: Any) -> str:
    reply = sdk.chat.completions.create(model=served_name, messages=messages,
                                        temperature=0, max_tokens=MAX_TOKENS, **fields)
    content = reply.choices[0].message.content
    assert content is not None
    return content


def text_of(message: Any) -> str:
    assert isinstance(message, AIMessage)
    assert isinstance(message.content, str)
    return message.content


def test_invoke_answers_as_the_sdk(daemon: Daemon, sdk: openai.OpenAI, served_name: str) -> None:
    # LangChain takes OpenAI-style role/content dicts as they are
    answer = chat_model(daemon, served_name).invoke(CONVERSATION)
    assert text_of(answer) == sdk_answer(sdk, served_name, CONVERSATION)
    assert answer.response_metadata["model_name"] == served_name
    assert answer.usage_metadata is not None
    assert 0 < answer.usage_metadata["output_tokens"] <= MAX_TOKENS


def test_stream_chunks_join_to_the_invoke_text(daemon: Daemon, served_name: str) -> None:
    chat = chat_model(daemon, served_name)
    whole = text_of(chat.invoke(CONVERSATION))
    chunks = list(chat.stream(CONVERSATION))
    assert all(isinstance(chunk.content, str) for chunk in chunks)
    assert "".join(str(chunk.content) for chunk in chunks) == whole
    reasons = [chunk.response_metadata.get("finish_reason") for chunk in chunks]
    assert [reason for reason in reasons if reason] in (["length"], ["stop"])


def test_batch_equals_one_invoke_per_prompt(daemon: Daemon, served_name: str) -> None:
    chat = chat_model(daemon, served_name)
    singles = [text_of(chat.invoke(prompt)) for prompt in PROMPTS]
    assert [text_of(answer) for answer in chat.batch(PROMPTS)] == singles


def test_penalties_are_served_as_the_sdk_serves_them(
        daemon: Daemon, sdk: openai.OpenAI, served_name: str) -> None:
    # invoke raises on any status but 200
    penalised = text_of(chat_model(daemon, served_name, **PENALTIES).invoke(REPEATING))
    assert penalised == sdk_answer(sdk, served_name, REPEATING, **PENALTIES)
    assert penalised != text_of(chat_model(daemon, served_name).invoke(REPEATING))


def test_logprobs_with_top_alternatives_reach_the_response_metadata(
        daemon: Daemon, served_name: str) -> None:
    chat = chat_model(daemon, served_name).bind(logprobs=True, top_logprobs=2)
    answer = chat.invoke(CONVERSATION)
    content = answer.response_metadata["logprobs"]["content"]
    assert answer.usage_metadata is not None
    assert len(content) == answer.usage_metadata["output_tokens"] > 0
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 2
        assert top[0]["logprob"] >= top[1]["logprob"]
        # greedy: the chosen token is the likeliest
        assert (entry["token"], entry["logprob"]) == (top[0]["token"], top[0]["logprob"])
