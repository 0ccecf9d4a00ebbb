"""Request validation on a real daemon: every field out of range is INVALID_ARGUMENT
naming it, request ids are checked before they are echoed, and prompts are sized
and tokenized off the event loop, which keeps answering meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specpage.client import Chunk, Client, generate_request
from specpage.engine.submission import MAX_CACHE_SALT_BYTES, PROMPT_BYTES_PER_TOKEN
from specpage.serve.frontend import MAX_REQUEST_ID_LENGTH
from specpage.serve.grpc_stubs import generation_pb2 as pb
from tests.support.checkpoints import SMOLLM2_VOCAB, tokenizer_pair
from tests.support.daemon import Daemon
from tests.support.loop_watch import TICK_S, LoopWatch

pytestmark = pytest.mark.asyncio(loop_scope="module")
VOCAB = SMOLLM2_VOCAB  # the tiny models share SmolLM2's tokenizer
MAX_PROMPT_TOKENS = 8000
MAX_PROMPT_BYTES = MAX_PROMPT_TOKENS * PROMPT_BYTES_PER_TOKEN
MAX_CONTEXT = 512  # the tiny models' max_position_embeddings
PROMPT = [5, 6, 7, 8]
GREEDY = dict(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    folder = tmp_path_factory.mktemp("validation")
    tokenizer_pair(folder / "models")
    process = Daemon(folder, server=f"max_prompt_tokens = {MAX_PROMPT_TOKENS}\n"
                                    f"max_message_bytes = {16 << 20}")
    process.wait_serving()
    yield process
    assert process.stop() == 0


async def rejection(client: Client, message: pb.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in client.stub.Generate(message):
            pass
    return error.value


async def still_serves(client: Client) -> None:
    completion = await client.complete(PROMPT, **GREEDY)
    assert completion.finish_reason == "length" and len(completion.token_ids) == 3


# ---------------------------------------------------------------- request ids

BAD_IDS = {
    "non-ASCII": ("r\u00e9sum\u00e9", "character U+00E9 is not printable ASCII (0x20-0x7E)"),
    "newline": ("a\nb", "character U+000A is not printable ASCII (0x20-0x7E)"),
    "NUL": ("a\x00b", "character U+0000 is not printable ASCII (0x20-0x7E)"),
    "DEL": ("a\x7fb", "character U+007F is not printable ASCII (0x20-0x7E)"),
    "129 characters": ("x" * 129, "129 characters exceed the limit of 128"),
    "100 KB": ("x" * 100_000, "100000 characters exceed the limit of 128"),
}


@pytest.mark.parametrize(("request_id", "message"), BAD_IDS.values(), ids=BAD_IDS.keys())
async def test_a_bad_request_id_is_invalid_argument(daemon, request_id, message):
    async with Client(daemon.address, max_retries=0) as client:
        error = await rejection(client, generate_request(PROMPT, request_id=request_id))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == f"request_id: {message}"
        with pytest.raises(grpc.aio.AioRpcError) as aborted:
            await client.abort(request_id)
        assert aborted.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert aborted.value.details() == f"request_id: {message}"
        await still_serves(client)
    assert "Traceback" not in daemon.log.read_text()


async def test_the_longest_printable_request_id_is_echoed(daemon):
    printable = "".join(map(chr, range(0x20, 0x7F)))  # 0x20 (space) to 0x7E (~)
    request_id = (printable * 2)[:MAX_REQUEST_ID_LENGTH - 1] + " "  # spaces at both ends
    async with Client(daemon.address, max_retries=0) as client:
        call = client.stub.Generate(generate_request(PROMPT, request_id=request_id, **GREEDY))
        assert dict(await call.initial_metadata())["request-id"] == request_id
        events = [event async for event in call]
        assert events[-1].final.finish_reason == "length"
        assert not await client.abort(request_id)  # valid, and finished


# ------------------------------------------------------ numbers and enums

INF, NAN = math.inf, math.nan
U32, U64 = 2**32 - 1, 2**64 - 1
# (GenerateRequest fields, SamplingParameters fields) -> the field named
BAD_FIELDS = [
    ({}, dict(temperature=INF), "temperature"),
    ({}, dict(temperature=-INF), "temperature"),
    ({}, dict(temperature=NAN), "temperature"),
    ({}, dict(temperature=-0.5), "temperature"),
    ({}, dict(top_p=INF), "top_p"),
    ({}, dict(top_p=-INF), "top_p"),
    ({}, dict(top_p=NAN), "top_p"),
    ({}, dict(top_p=0.0), "top_p"),
    ({}, dict(top_p=1.5), "top_p"),
    ({}, dict(max_tokens=0), "max_tokens"),
    # 8 samples each to the context's end: more KV blocks than the pool has
    ({}, dict(max_tokens=U32, n=8), "max_tokens"),
    ({}, dict(n=0), "n"),
    ({}, dict(n=65), "n"),
    ({}, dict(n=U32), "n"),
    ({}, dict(seed=2**63), "seed"),
    ({}, dict(seed=U64), "seed"),
    ({}, dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
    ({}, dict(stop_token_ids=[3, U32]), "stop_token_ids"),
    (dict(timeout_s=INF), {}, "timeout_s"),
    (dict(timeout_s=-INF), {}, "timeout_s"),
    (dict(timeout_s=NAN), {}, "timeout_s"),
    (dict(timeout_s=0.0), {}, "timeout_s"),
    (dict(spec=3), {}, "spec"),
    (dict(spec=-1), {}, "spec"),
    (dict(spec=2**31 - 1), {}, "spec"),
    (dict(chat=True), {}, "chat"),  # the template wraps text; the prompt is token ids
    (dict(token_ids=[5, VOCAB]), {}, "token_ids"),
    (dict(token_ids=[5] * MAX_CONTEXT), {}, "token_ids"),  # beyond the model's context
    (dict(cache_salt="s" * (MAX_CACHE_SALT_BYTES + 1)), {}, "cache_salt"),
    (dict(cache_salt="\u00e9" * (MAX_CACHE_SALT_BYTES // 2 + 1)), {}, "cache_salt"),  # bytes
]


@pytest.mark.parametrize(("fields", "sampling", "name"), BAD_FIELDS,
                         ids=[f"{name}={str([*f.values(), *s.values()][0])[:16]}"
                              for f, s, name in BAD_FIELDS])
async def test_an_out_of_range_field_is_invalid_argument_naming_it(daemon, fields, sampling,
                                                                    name):
    message = pb.GenerateRequest(token_ids=PROMPT, sampling=pb.SamplingParameters(**sampling))
    for key, value in fields.items():
        if key == "token_ids":
            del message.token_ids[:]
            message.token_ids.extend(value)
        else:
            setattr(message, key, value)
    async with Client(daemon.address, max_retries=0) as client:
        error = await rejection(client, message)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith(f"{name}: ")
        await still_serves(client)


# Chosen as vLLM does: a top_k beyond the vocabulary keeps every token; any
# int32 priority orders requests; a huge but finite temperature or timeout is a number.
EXTREMES = [
    ({}, dict(top_k=U32, temperature=1.0, seed=1)),
    ({}, dict(top_k=VOCAB + 1, temperature=1.0, seed=1)),
    (dict(priority=-(2**31)), {}),
    (dict(priority=2**31 - 1), {}),
    ({}, dict(temperature=3.4e38, seed=2)),  # float32's largest
    (dict(timeout_s=1e300), {}),
    ({}, dict(seed=2**63 - 1, temperature=1.0)),
    (dict(spec=pb.SPEC_ON), {}),
    (dict(cache_salt="s" * MAX_CACHE_SALT_BYTES), {}),
]


@pytest.mark.parametrize(("fields", "sampling"), EXTREMES)
async def test_extreme_but_valid_values_are_served(daemon, fields, sampling):
    message = pb.GenerateRequest(token_ids=PROMPT, **fields, sampling=pb.SamplingParameters(
        **{"max_tokens": 3, "temperature": 0.0, "ignore_eos": True, **sampling}))
    async with Client(daemon.address, max_retries=0) as client:
        events = [event async for event in client.stub.Generate(message)]
    tokens = [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids]
    assert events[-1].final.finish_reason == "length" and len(tokens) == 3
    assert all(0 <= t < VOCAB for t in tokens)


async def test_max_tokens_past_the_context_runs_to_its_end(daemon):
    """As llama.cpp's server does: the output ends where the context does,
    and the pool is asked only for the blocks the context holds."""
    async with Client(daemon.address, max_retries=0) as client:
        completion = await client.complete(PROMPT, max_tokens=U32, temperature=0.0,
                                           ignore_eos=True)
    assert completion.finish_reason == "length"
    assert len(PROMPT) + len(completion.token_ids) == MAX_CONTEXT


async def test_top_k_beyond_the_vocabulary_keeps_every_token(daemon):
    """Same seeded samples as top_k = 0."""
    async with Client(daemon.address, max_retries=0) as client:
        outputs = [await client.complete(PROMPT, max_tokens=8, temperature=1.0, seed=7,
                                          ignore_eos=True, top_k=top_k)
                   for top_k in (0, VOCAB, U32)]
    assert outputs[0].token_ids == outputs[1].token_ids == outputs[2].token_ids


# ----------------------------------------------------------- prompt sizes


async def test_text_over_the_byte_limit_is_refused_before_tokenizing(daemon):
    async with Client(daemon.address, max_retries=0) as client:
        for text in ("a" * (MAX_PROMPT_BYTES + 1), "\u00e9" * (MAX_PROMPT_BYTES // 2 + 1)):
            for chat in (False, True):
                error = await rejection(client, generate_request(text, chat=chat))
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.details() == (
                    f"text: {len(text.encode())} bytes exceed the limit of "
                    f"{MAX_PROMPT_BYTES} ({MAX_PROMPT_TOKENS} tokens)")
        await still_serves(client)


async def test_token_ids_over_the_limit_are_refused_by_their_count_first(daemon):
    """Ids outside the vocabulary too: the count is checked before any id."""
    async with Client(daemon.address, max_retries=0) as client:
        for ids in ([7] * (MAX_PROMPT_TOKENS + 1), [VOCAB + 1] * (MAX_PROMPT_TOKENS + 1)):
            error = await rejection(client, generate_request(ids))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == (f"token_ids: {MAX_PROMPT_TOKENS + 1} tokens exceed the "
                                       f"limit of {MAX_PROMPT_TOKENS}")
        await still_serves(client)


def words_text(size: int) -> str:
    """Random lowercase words: about two bytes per token, so a text just under
    the byte limit has far more tokens than the limit and takes seconds."""
    rng = random.Random(0)
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                          for _ in range(rng.randrange(2, 9))) for _ in range(5000)]
    return " ".join(rng.choices(vocabulary, k=size // 3))[:size]  # ~6.5 bytes a word


async def answer_health_checks(address: str, answers: list[float], stop: asyncio.Event) -> None:
    # Its own channel and connection, beside the client's.
    async with grpc.aio.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            reply = await stub.Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            answers.append(time.perf_counter())
            await asyncio.sleep(TICK_S)


async def stream_chunks(client: Client, answers: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        async with contextlib.aclosing(client.generate(
                PROMPT, max_tokens=MAX_CONTEXT - 32, temperature=0.0, ignore_eos=True)) as events:
            async for event in events:
                if isinstance(event, Chunk):
                    answers.append(time.perf_counter())
                if stop.is_set():
                    break


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
async def test_tokenizing_a_large_prompt_leaves_the_event_loop_serving(daemon, chat):
    """A text just under the byte limit is tokenized (seconds of work) and then
    refused for its token count. Meanwhile health checks and another stream's
    chunks keep being answered: the answers before the refusal leave no gap
    longer than half the time the refusal took, beyond this process's own
    lateness. Tokenizing on the event loop froze both for nearly all of it."""
    text = words_text(MAX_PROMPT_BYTES - 1000)
    health: list[float] = []
    chunks: list[float] = []
    stop = asyncio.Event()
    async with LoopWatch() as watch, Client(daemon.address, max_retries=0) as client:
        tasks = [asyncio.create_task(answer_health_checks(daemon.address, health, stop)),
                 asyncio.create_task(stream_chunks(client, chunks, stop))]
        while not (health and chunks):
            await asyncio.sleep(TICK_S)
        sent = time.perf_counter()
        error = await rejection(client, generate_request(text, chat=chat))
        refused = time.perf_counter()
        stop.set()
        await asyncio.gather(*tasks)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("text: ")
    assert error.details().endswith(f"tokens do not fit the model's context of {MAX_CONTEXT}")
    assert int(error.details().split()[1]) > MAX_PROMPT_TOKENS
    window = refused - sent
    for name, times in (("health", health), ("chunks", chunks)):
        answered = [sent, *(t for t in times if sent < t < refused), refused]
        longest = max(b - a for a, b in zip(answered, answered[1:], strict=False))
        assert longest < window / 2 + watch.late_s, (name, longest, window, watch.late_s)
