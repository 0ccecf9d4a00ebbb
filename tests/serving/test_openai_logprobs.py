"""Log-probabilities on a real daemon (a tiny fp32 target, a draft model
speculating, prefill in chunks of 8 positions), over HTTP through the
`openai` SDK and over gRPC through the Python client: echo'd prompts, vLLM's
prompt_logprobs and the gRPC prompt's log-probabilities equal log_softmax
of transformers' logits within 1e-4, through chunked prefill and after a
request that left the prompt in the prefix cache; chat's top_logprobs and
the legacy top alternatives are sorted and the target's; max_tokens 0 with
echo gives the prompt alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from specpage.client import Client
from specpage.engine.builder import load_tokenizer
from tests.serving.test_openai_api import TIMEOUT_S
from tests.support.checkpoints import tokenizer_pair
from tests.support.daemon import Daemon, free_port

pytestmark = pytest.mark.asyncio(loop_scope="module")
TOLERANCE = 1e-4
CHUNK = 8  # max_step_tokens: a prompt longer than this is prefilled in steps
LONG = [281, 1538, 314, 253, 2365, 30, 378, 7564, 314, 1345, 3153, 28, 284, 260, 1690,
        3153, 314, 2365, 2032, 30, 378, 6030, 28, 1045, 5473]  # 25 tokens: 4 chunks
SHORT = [19556, 1342, 28, 9361, 314, 2365, 30]  # one chunk, a block to cache


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("openai-logprobs")
    tokenizer_pair(folder / "models")
    return folder


@pytest.fixture(scope="module")
def daemon(models: Path) -> Iterator[Daemon]:
    process = Daemon(models, http=True, engine=f"max_step_tokens = {CHUNK}",
                     server=f"metrics_port = {free_port()}")
    process.wait_serving()
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def hf(models: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(models / "models" / "target",
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def text_of(models: Path) -> Any:
    tokenizer = load_tokenizer(models / "models" / "target")
    return lambda t: tokenizer.decode([t])


def log_softmax(hf: Any, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row i the log-probabilities of the token after i."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)


def rank_range(row: torch.Tensor, token: int) -> tuple[int, int]:
    """The ranks token may have in row, as close values may fall either way."""
    return (int((row > row[token] + TOLERANCE).sum()) + 1,
            int((row > row[token] - TOLERANCE).sum()) + 1)


def check_top(row: torch.Tensor, top: list[tuple[int, float]], n: int) -> None:
    """top is row's n likeliest, likeliest first (close values may swap ids)."""
    assert [lp for _, lp in top] == pytest.approx(row.topk(n).values.tolist(), abs=TOLERANCE)
    assert all(abs(float(row[t]) - lp) < TOLERANCE for t, lp in top)


def sdk(daemon: Daemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused",
                              max_retries=0, timeout=TIMEOUT_S)


async def cache(client: openai.AsyncOpenAI, prompt: list[int]) -> None:
    """A request that leaves the prompt's blocks in the prefix cache, and the
    proof that a plain repeat hits them."""
    for _ in range(2):
        reply = await client.completions.create(model="", prompt=prompt, max_tokens=1,
                                                temperature=0.0)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["one-chunk", "chunked"])
@pytest.mark.parametrize("max_tokens", [0, 2])
async def test_echo_gives_the_prompts_log_probabilities(daemon: Daemon, hf: Any,
                                                        text_of: Any, prompt: list[int],
                                                        max_tokens: int) -> None:
    async with sdk(daemon) as client:
        await cache(client, prompt)
        reply = await client.completions.create(
            model="", prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=3,
            echo=True, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # it recomputed
    assert reply.usage.completion_tokens == max_tokens
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == len(prompt) + max_tokens
    expected = log_softmax(hf, prompt)
    assert choice.text == (await detokenize(daemon, prompt)) + "".join(
        logprobs.tokens[len(prompt):])
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(prompt)):
        row, token = expected[position - 1], prompt[position]
        assert logprobs.tokens[position] == text_of(token)
        assert abs(logprobs.token_logprobs[position] - float(row[token])) < TOLERANCE
        top = logprobs.top_logprobs[position]
        assert top is not None and 3 <= len(top) <= 4  # the 3 likeliest and the token
        values = sorted(top.values(), reverse=True)
        assert values[:3] == pytest.approx(row.topk(3).values.tolist(), abs=TOLERANCE)
        assert top[text_of(token)] == logprobs.token_logprobs[position]
    offsets = logprobs.text_offset
    assert offsets is not None and offsets[0] == 0 and offsets == sorted(offsets)
    if max_tokens:  # the first generated token, greedy: the target's likeliest
        assert abs(logprobs.token_logprobs[len(prompt)] - float(expected[-1].max())) < TOLERANCE


async def detokenize(daemon: Daemon, ids: list[int]) -> str:
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=TIMEOUT_S) as http:
        return str((await http.post("/detokenize", json={"tokens": ids})).json()["prompt"])


async def test_vllm_prompt_logprobs(daemon: Daemon, hf: Any, text_of: Any) -> None:
    async with sdk(daemon) as client:
        await cache(client, LONG)
        reply = await client.completions.create(
            model="", prompt=LONG, max_tokens=1, temperature=0.0,
            extra_body={"prompt_logprobs": 2})
    found = reply.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    expected = log_softmax(hf, LONG)
    assert found[0] is None and len(found) == len(LONG)
    for position in range(1, len(LONG)):
        row, token = expected[position - 1], LONG[position]
        entries = found[position]
        mine = entries[str(token)]
        assert abs(mine["logprob"] - float(row[token])) < TOLERANCE
        assert rank_range(row, token)[0] <= mine["rank"] <= rank_range(row, token)[1]
        assert mine["decoded_token"] == text_of(token)
        top = sorted(((int(t), e["logprob"]) for t, e in entries.items() if e["rank"] <= 2),
                     key=lambda pair: -pair[1])
        check_top(row, top, 2)


async def test_chat_top_logprobs_are_the_targets_sorted(daemon: Daemon) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    async with Client(daemon.address, max_retries=0) as grpc_client:
        expected = await grpc_client.complete("Hello there", chat=True, max_tokens=6,
                                              temperature=0.0, ignore_eos=True, logprobs=True,
                                              top_logprobs=5)
    async with sdk(daemon) as client:
        reply = await client.chat.completions.create(
            model="", messages=messages, max_tokens=6, temperature=0.0,  # type: ignore[arg-type]
            logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError) as error:
            await client.chat.completions.create(
                model="", messages=messages, logprobs=True,  # type: ignore[arg-type]
                top_logprobs=21)
        assert error.value.param == "top_logprobs"
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for entry, logprob, top in zip(content, expected.samples[0].logprobs,
                                   expected.samples[0].top_logprobs, strict=True):
        assert abs(entry.logprob - logprob) < TOLERANCE
        values = [alternative.logprob for alternative in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert values == pytest.approx([lp for _, lp in top], abs=TOLERANCE)
        assert abs(values[0] - entry.logprob) < TOLERANCE  # greedy: the likeliest
        assert entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())


async def test_grpc_prompt_and_top_logprobs_equal_transformers(daemon: Daemon,
                                                               hf: Any) -> None:
    async with Client(daemon.address, max_retries=0) as client:
        completion = await client.complete(LONG, max_tokens=4, temperature=0.0,
                                           ignore_eos=True, logprobs=True, top_logprobs=4,
                                           prompt_logprobs=3)
        chunks = [event async for event in client.generate(
            LONG, max_tokens=1, temperature=0.0, prompt_logprobs=0)]
    sample = completion.samples[0]
    expected = log_softmax(hf, LONG + sample.token_ids)
    found = sample.prompt_logprobs
    assert found is not None and found[0] is None and len(found) == len(LONG)
    for position in range(1, len(LONG)):
        row, token, entry = expected[position - 1], LONG[position], found[position]
        assert entry is not None
        assert abs(entry.logprob - float(row[token])) < TOLERANCE
        assert rank_range(row, token)[0] <= entry.rank <= rank_range(row, token)[1]
        check_top(row, entry.top, 3)
    for j, (token, top) in enumerate(zip(sample.token_ids, sample.top_logprobs, strict=True)):
        row = expected[len(LONG) - 1 + j]
        assert abs(float(row[token]) - float(row.max())) < TOLERANCE  # greedy
        check_top(row, top, 4)
    first = chunks[0]
    assert first.prompt_token_ids == LONG  # type: ignore[union-attr]
    assert first.prompt_logprobs is not None  # type: ignore[union-attr]
    assert all(p is None or p.top == [] for p in first.prompt_logprobs)  # type: ignore[union-attr]


async def test_out_of_range_counts_are_400s_naming_the_field(daemon: Daemon) -> None:
    async with sdk(daemon) as client:
        for fields, name in (({"logprobs": 6}, "logprobs"),
                             ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
                             ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs")):
            with pytest.raises(openai.BadRequestError) as error:
                await client.completions.create(model="", prompt=SHORT, max_tokens=1,
                                                **fields)  # type: ignore[arg-type]
            assert error.value.param == name
        with pytest.raises(openai.BadRequestError) as error:  # no echo: nothing to show
            await client.completions.create(model="", prompt=SHORT, max_tokens=0)
        assert error.value.param == "max_tokens"


async def test_a_streamed_echo_opens_with_the_prompt(daemon: Daemon) -> None:
    fields: dict[str, Any] = dict(model="", prompt=LONG, max_tokens=3, temperature=0.0,
                                  logprobs=1, echo=True, extra_body={"ignore_eos": True})
    async with sdk(daemon) as client:
        whole = await client.completions.create(**fields)
        stream = await client.completions.create(stream=True, **fields)
        chunks = [chunk.choices[0] async for chunk in stream]
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    assert chunks[0].text.startswith(await detokenize(daemon, LONG))
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens or []]
    logprobs = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs or []]
    assert whole.choices[0].logprobs is not None
    assert tokens == whole.choices[0].logprobs.tokens
    assert logprobs == whole.choices[0].logprobs.token_logprobs
