"""Prompts are templated and tokenized by AsyncEngine's pool of
PREPARE_CONCURRENCY threads, never on the event loop or the step thread: a
client that cancels each call while its prompt is being tokenized cannot keep
more of them busy (the work of a cancelled call runs on, so a semaphore
released on cancel would let it start any number), a call cancelled while its
prompt waits for a thread drops it, and so does stopping the engine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specpage.client import Client
from specpage.core.request import SamplingParams
from specpage.engine import Engine, EngineConfig
from specpage.engine.async_engine import (
    PREPARE_CONCURRENCY,
    PREPARE_THREAD_NAME,
    AsyncEngine,
    DrainingError,
    Final,
    RequestStream,
)
from specpage.engine.builder import load_tokenizer
from specpage.engine.submission import ChatPrompt, Prompt, RequestOptions, TextPrompt, TokenPrompt
from specpage.models.loader import load_model
from tests.support.checkpoints import tiny_checkpoint, tokenizer_pair
from tests.support.inprocess import serving_engine

CALLS = PREPARE_CONCURRENCY + 4
STARTED_WAIT_S = 0.5  # how long a call with no free thread is given to start one anyway
RELEASE_TIMEOUT_S = 60.0  # a prepare that is never released fails the test


def tiny_engine(folder: Path) -> Engine:
    tiny_checkpoint(folder)
    return Engine(load_model(folder), None, None,
                  EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4))


class BlockingPrepare:
    """Wraps the engine's make_request, the last of each prepare on the pool:
    each one blocks until released and the most running at once is counted."""

    def __init__(self, engine: Engine) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.running = 0
        self.most = 0
        self.calls = 0  # every prepare that reached make_request
        self._lock = threading.Lock()
        prepare = engine.make_request

        def blocking(*args: object, **options: object) -> object:
            with self._lock:
                self.calls += 1
                self.running += 1
                self.most = max(self.most, self.running)
            self.started.release()
            try:
                assert self.release.wait(RELEASE_TIMEOUT_S)
                return prepare(*args, **options)  # type: ignore[arg-type]
            finally:
                with self._lock:
                    self.running -= 1

        engine.make_request = blocking  # type: ignore[method-assign]


@pytest.mark.asyncio
async def test_calls_cancelled_while_tokenizing_cannot_start_more_tokenizers(tmp_path: Path):
    engine = tiny_engine(tmp_path)
    async with serving_engine(engine) as served:
        prepare = BlockingPrepare(engine)
        try:
            await cancel_while_preparing(served.address, prepare)
        finally:
            prepare.release.set()


async def cancel_while_preparing(address: str, prepare: BlockingPrepare) -> None:
    async with Client(address, max_retries=0) as client:
        for i in range(CALLS):
            call = asyncio.create_task(client.complete([1, 2, 3], max_tokens=2,
                                                       request_id=f"r{i}"))
            # cancelled once its prompt is being prepared: the first ones take every
            # thread, however long they take to get there; those after them find none
            # free, and are cancelled after a while (if one started a prepare anyway,
            # `most` counts it)
            free = i < PREPARE_CONCURRENCY
            started = await asyncio.to_thread(prepare.started.acquire, True,
                                              RELEASE_TIMEOUT_S if free else STARTED_WAIT_S)
            assert started or not free, f"r{i} never started preparing"
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        assert prepare.most == PREPARE_CONCURRENCY
        prepare.release.set()
        while prepare.running:
            await asyncio.sleep(0.01)
        # the daemon still serves
        completion = await client.complete([1, 2, 3], max_tokens=2, temperature=0.0)
        assert len(completion.token_ids) == 2
    assert prepare.most == PREPARE_CONCURRENCY


def add_requests(async_engine: AsyncEngine, ids: range) -> list[asyncio.Task[RequestStream]]:
    return [asyncio.create_task(async_engine.add_request(
        TokenPrompt([1, 2, 3]), SamplingParams(max_tokens=2), RequestOptions(f"r{i}", 0.0)))
        for i in ids]


@pytest.mark.asyncio
async def test_a_call_cancelled_while_waiting_for_a_thread_drops_its_prompt(tmp_path: Path):
    """Its prompt is never prepared: the next call's is, right after those
    that were being prepared."""
    engine = tiny_engine(tmp_path)
    async_engine = AsyncEngine(engine)  # not started: nothing is stepped
    prepare = BlockingPrepare(engine)
    calls = add_requests(async_engine, range(CALLS))
    try:
        for _ in range(PREPARE_CONCURRENCY):
            assert await asyncio.to_thread(prepare.started.acquire, True, RELEASE_TIMEOUT_S)
        for call in calls[PREPARE_CONCURRENCY:]:
            call.cancel()
        await asyncio.wait(calls[PREPARE_CONCURRENCY:])
    finally:
        prepare.release.set()
    admitted = [await call for call in calls[:PREPARE_CONCURRENCY]]
    # the pool's queue is first in, first out: a cancelled prompt left in it
    # would be prepared before this one
    [last] = add_requests(async_engine, range(CALLS, CALLS + 1))
    admitted.append(await last)
    assert prepare.calls == PREPARE_CONCURRENCY + 1
    assert [stream.request_id for stream in admitted] == ["r0", "r1", f"r{CALLS}"]
    assert sorted(async_engine.streams) == ["r0", "r1", f"r{CALLS}"]
    await async_engine.stop(timeout=1)


@pytest.mark.asyncio
async def test_stopping_drops_the_prompts_waiting_for_a_thread(tmp_path: Path):
    """The calls whose prompts wait for a thread end at once with DrainingError;
    those being prepared end with it when they finish, and are never admitted."""
    engine = tiny_engine(tmp_path)
    async_engine = AsyncEngine(engine)  # not started: nothing is stepped
    prepare = BlockingPrepare(engine)
    calls = add_requests(async_engine, range(CALLS))
    for _ in range(PREPARE_CONCURRENCY):
        assert await asyncio.to_thread(prepare.started.acquire, True, RELEASE_TIMEOUT_S)
    try:
        await async_engine.stop(timeout=1)
        waiting = calls[PREPARE_CONCURRENCY:]
        _, still_waiting = await asyncio.wait(waiting, timeout=RELEASE_TIMEOUT_S)
        assert not still_waiting
        assert all(isinstance(call.exception(), DrainingError) for call in waiting)
        assert not any(call.done() for call in calls[:PREPARE_CONCURRENCY])
    finally:
        prepare.release.set()
    for call in calls[:PREPARE_CONCURRENCY]:
        with pytest.raises(DrainingError):
            await call
    assert prepare.calls == PREPARE_CONCURRENCY
    assert not async_engine.streams


class ThreadsOf:
    """Wraps a tokenizer's encode and apply_chat_template: the names of the
    threads each ran on."""

    def __init__(self, tokenizer: Any) -> None:
        self.names: dict[str, list[str]] = {"encode": [], "apply_chat_template": []}
        for method, names in self.names.items():
            setattr(tokenizer, method, self._recorded(getattr(tokenizer, method), names))

    @staticmethod
    def _recorded(method: Callable[..., Any], names: list[str]) -> Callable[..., Any]:
        def recorded(*args: Any, **options: Any) -> Any:
            names.append(threading.current_thread().name)
            return method(*args, **options)

        return recorded


@pytest.mark.asyncio
@pytest.mark.parametrize(("prompt", "method"), [
    (TextPrompt("The capital of France is"), "encode"),
    (ChatPrompt([{"role": "user", "content": "The capital of France?"}]),
     "apply_chat_template"),
], ids=["text", "chat"])
async def test_prompts_are_tokenized_on_the_prepare_pool(
        tmp_path: Path, prompt: Prompt, method: str):
    tokenizer_pair(tmp_path)
    tokenizer = load_tokenizer(tmp_path / "target")
    engine = Engine(load_model(tmp_path / "target"), None, tokenizer,
                    EngineConfig(block_size=4, num_blocks=64))
    threads = ThreadsOf(tokenizer)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        stream = await async_engine.add_request(
            prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
            RequestOptions("r", 0.0))
        events = [event async for event in stream.events()]
    finally:
        await async_engine.stop(timeout=1)
    assert isinstance(events[-1], Final) and events[-1].finish_reasons == ["length"]
    assert threads.names[method]  # the prompt went through it
    names = [name for calls in threads.names.values() for name in calls]
    assert all(name.startswith(f"{PREPARE_THREAD_NAME}_") for name in names), names
    assert threading.current_thread().name not in names  # the event loop's


@pytest.mark.asyncio
async def test_a_constraint_compiles_on_the_prepare_pool_while_other_streams_run(
        tmp_path: Path):
    from specpage.core.grammar import json_schema

    tokenizer_pair(tmp_path)
    engine = Engine(load_model(tmp_path / "target"), None, load_tokenizer(tmp_path / "target"),
                    EngineConfig(block_size=4, num_blocks=64))
    grammars = engine.intake.grammars
    compile_ = grammars.compile
    release, compiling = threading.Event(), threading.Event()
    names: list[str] = []

    def held(constraint: Any) -> Any:  # a schema that takes as long as the test says
        names.append(threading.current_thread().name)
        compiling.set()
        assert release.wait(RELEASE_TIMEOUT_S)
        return compile_(constraint)

    grammars.compile = held  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        other = await async_engine.add_request(TokenPrompt([5, 6, 7]), params,
                                               RequestOptions("other", 0.0))
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False}
        constrained = asyncio.ensure_future(async_engine.add_request(
            TokenPrompt([5, 6, 7]), SamplingParams(max_tokens=20, temperature=0.0),
            RequestOptions("constrained", 0.0, constraint=json_schema(schema, "guided_json"))))
        await asyncio.get_running_loop().run_in_executor(None, compiling.wait)
        # the other stream runs to its end while the schema is still compiling
        events = [event async for event in other.events()]
        assert isinstance(events[-1], Final) and events[-1].finish_reasons == ["length"]
        assert not constrained.done()
        release.set()
        stream = await constrained
        events = [event async for event in stream.events()]
    finally:
        release.set()
        await async_engine.stop(timeout=1)
    assert isinstance(events[-1], Final) and events[-1].finish_reasons == ["stop"]
    assert names and all(name.startswith(f"{PREPARE_THREAD_NAME}_") for name in names)
