"""The sampling fields of OpenAI and vLLM on the HTTP front, through the
`openai` SDK on a real daemon (a tiny fp32 target with a draft model
speculating): penalties, min_p and logit_bias give transformers' greedy
tokens adjusted by the engine tests' reference, min_tokens holds a biased
EOS back, chat takes them as gRPC does, and a value out of range is a 400
naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from specpage.client import Client
from specpage.engine.builder import load_tokenizer
from specpage.models.loader import load_model
from tests.serving.test_openai_api import TIMEOUT_S
from tests.speculation.test_penalties import ADJUSTED, GREEDY, PROMPTS, hf_decode
from tests.support.checkpoints import tokenizer_pair
from tests.support.daemon import Daemon, http_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")
MAX_TOKENS = 8
# the SDK's own keywords; the rest are vLLM's and go in extra_body
OPENAI_FIELDS = ("presence_penalty", "frequency_penalty", "logit_bias")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("openai-sampling")
    tokenizer_pair(folder / "models")
    return folder


@pytest.fixture(scope="module")
def daemon(models: Path) -> Iterator[Daemon]:
    yield from http_daemon(models)


@pytest.fixture(scope="module")
def hf(models: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(models / "models" / "target",
                                                dtype=torch.float32).eval()


def sdk(daemon: Daemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused",
                              max_retries=0, timeout=TIMEOUT_S)


def body(fields: dict[str, Any]) -> dict[str, Any]:
    """fields as the SDK takes them: OpenAI's as keywords, vLLM's in extra_body;
    logit_bias keyed by strings, as JSON writes them."""
    openai_fields = {name: value for name, value in fields.items() if name in OPENAI_FIELDS}
    if "logit_bias" in openai_fields:
        openai_fields["logit_bias"] = {str(t): b for t, b in fields["logit_bias"].items()}
    extra = {name: value for name, value in fields.items() if name not in OPENAI_FIELDS}
    return {**openai_fields, "extra_body": {"ignore_eos": True, **extra}}


@pytest.fixture(scope="module")
def decode(models: Path) -> Any:
    """Token ids -> each token's text, as a completion's logprobs.tokens."""
    tokenizer = load_tokenizer(models / "models" / "target")
    return lambda ids: [tokenizer.decode([t]) for t in ids]


@pytest.mark.parametrize("adjust", list(ADJUSTED), ids=list(ADJUSTED))
async def test_each_adjustment_gives_transformers_adjusted_greedy_tokens(
        daemon: Daemon, hf: Any, decode: Any, adjust: str) -> None:
    params = msgspec.structs.replace(GREEDY, max_tokens=MAX_TOKENS, **ADJUSTED[adjust])
    async with sdk(daemon) as client:
        for prompt in PROMPTS:
            reply = await client.completions.create(
                model="", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                **body(ADJUSTED[adjust]))
            expected = hf_decode(hf, prompt, params, MAX_TOKENS)
            assert reply.choices[0].logprobs is not None
            assert reply.choices[0].logprobs.tokens == decode(expected), (adjust, expected)
            assert reply.usage is not None and reply.usage.completion_tokens == MAX_TOKENS


async def test_a_large_logit_bias_makes_greedy_output_that_token(daemon: Daemon,
                                                                 decode: Any) -> None:
    async with sdk(daemon) as client:
        reply = await client.completions.create(
            model="", prompt=PROMPTS[0], max_tokens=5, temperature=0.0, logprobs=0,
            logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert reply.choices[0].logprobs is not None
    assert reply.choices[0].logprobs.tokens == decode([42] * 5)


async def test_min_tokens_holds_a_biased_eos_back(daemon: Daemon) -> None:
    eos = load_model(daemon.config.parent / "models" / "target").config.eos_token_ids[0]
    async with sdk(daemon) as client:
        for min_tokens in (0, 3):
            reply = await client.completions.create(
                model="", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0,
                logit_bias={str(eos): 100}, extra_body={"min_tokens": min_tokens})
            assert reply.choices[0].finish_reason == "stop"
            assert reply.usage is not None
            assert reply.usage.completion_tokens == min_tokens + 1


async def test_chat_takes_the_fields_as_grpc_does(daemon: Daemon) -> None:
    fields = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3,
                  min_p=0.2, logit_bias={9: 1.0, 42: 5.0})
    messages = [{"role": "user", "content": "Hello there"}]
    async with Client(daemon.address, max_retries=0) as grpc_client:
        expected = await grpc_client.complete("Hello there", chat=True, max_tokens=MAX_TOKENS,
                                              temperature=0.0, ignore_eos=True, **fields)
        plain = await grpc_client.complete("Hello there", chat=True, max_tokens=MAX_TOKENS,
                                           temperature=0.0, ignore_eos=True)
    assert expected.token_ids != plain.token_ids  # the fields change the output
    async with sdk(daemon) as client:
        reply = await client.chat.completions.create(
            model="", messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            temperature=0.0, **body(fields))
    assert reply.choices[0].message.content == expected.text


OUT_OF_RANGE: dict[str, dict[str, Any]] = {
    "presence_penalty": {"presence_penalty": 2.5},
    "frequency_penalty": {"frequency_penalty": -3.0},
    "repetition_penalty": {"repetition_penalty": 0.0},
    "min_p": {"min_p": 1.5},
    "min_tokens": {"min_tokens": 9},  # above max_tokens
    "logit_bias": {"logit_bias": {"5": 101.0}},
}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_out_of_range_values_are_400s_naming_the_field(daemon: Daemon,
                                                             chat: bool) -> None:
    refusals = [*OUT_OF_RANGE.items(), ("logit_bias", {"logit_bias": {"five": 1.0}}),
                ("logit_bias", {"logit_bias": {"-1": 1.0}}),
                ("logit_bias", {"logit_bias": {str(49152): 1.0}})]  # SmolLM2's vocabulary
    async with sdk(daemon) as client:
        for name, fields in refusals:
            with pytest.raises(openai.BadRequestError) as error:
                if chat:
                    await client.chat.completions.create(
                        model="", messages=[{"role": "user", "content": "Hi"}],
                        max_tokens=MAX_TOKENS, extra_body=fields)
                else:
                    await client.completions.create(model="", prompt="Hi",
                                                    max_tokens=MAX_TOKENS, extra_body=fields)
            assert error.value.param == name, (fields, error.value.message)
