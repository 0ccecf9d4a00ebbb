"""How a Generate call ends when samples end differently, and the admission
bound while a step is in flight: the daemon's servicer and AsyncEngine over
real gRPC on 127.0.0.1, with a gate on the engine's step so each test acts at
a chosen step boundary instead of racing the clock."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from specpage.client import Chunk, Client, Final, IncompleteError
from specpage.core.request import Request, SamplingParams
from specpage.engine import Engine, EngineConfig
from specpage.models.loader import load_model
from tests.support.checkpoints import tiny_checkpoint
from tests.support.inprocess import Served, serving_engine

PROMPT = [5, 17, 33, 2, 101, 7, 88]
SEED = 0  # sample 0's first token never comes up in sample 1's first tokens (checked below)
GATE_TIMEOUT_S = 60.0  # a held step that is never let go fails the test instead of hanging it
UNREACHED_TIMEOUT_S = 600.0  # a request timeout that only a test passes (by moving it)


def engine_config(max_num_seqs: int = 4) -> EngineConfig:
    return EngineConfig(block_size=4, num_blocks=256, max_num_seqs=max_num_seqs)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("target")
    tiny_checkpoint(folder)
    return folder


@pytest.fixture(scope="module")
def two_samples(target: Path) -> dict[int, list[int]]:
    """The first tokens of the n = 2 request the tests send, from the
    offline engine (no draft, so the daemon's engine samples the same)."""
    engine = Engine(load_model(target), None, None, engine_config())
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, temperature=1.0, seed=SEED, n=2,
                                                   ignore_eos=True))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.index] += out.token_ids
    assert tokens[0][0] not in tokens[1], tokens  # sample 0 stops at once, sample 1 runs on
    return tokens


def sampling(tokens: dict[int, list[int]], max_tokens: int) -> dict[str, object]:
    """Sample 0 stops at its first token; sample 1 runs until max_tokens."""
    return dict(max_tokens=max_tokens, temperature=1.0, seed=SEED, n=2, ignore_eos=True,
                stop_token_ids=[tokens[0][0]])


class Gate:
    """Holds the engine's step (in its worker thread, after the step has
    taken the new submissions and aborts) until the test allows it."""

    def __init__(self, engine: Engine, hold: Callable[[], bool]) -> None:
        self._hold = hold
        self._allowed = 0
        self._cond = threading.Condition()
        self.held = threading.Event()
        step = engine.step

        def gated() -> list:
            with self._cond:
                while self._hold() and self._allowed == 0:
                    self.held.set()
                    assert self._cond.wait(GATE_TIMEOUT_S), "a held step was never let go"
                self.held.clear()
                self._allowed = max(0, self._allowed - 1)
            return step()

        engine.step = gated

    def allow(self, steps: int = 1) -> None:
        with self._cond:
            self._allowed += steps
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._hold = lambda: False
            self._cond.notify_all()

    async def wait_held(self) -> None:
        """Until a step is held at the gate (after any allowed ones ran)."""
        while not (self.held.is_set() and self._allowed == 0):
            await asyncio.to_thread(self.held.wait, GATE_TIMEOUT_S)
            await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def serving(target: Path, max_num_seqs: int = 4, max_queue: int = 8) -> AsyncIterator[Served]:
    engine = Engine(load_model(target), None, None, engine_config(max_num_seqs))
    async with serving_engine(engine, max_queue) as served:
        yield served


async def collect(client: Client, request_id: str, **options: object) -> tuple[
        dict[int, list[int]], dict[int, str | None], list[Final], grpc.aio.AioRpcError | None]:
    """Tokens and last finish reason per sample, Final events, the error."""
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str | None] = {}
    finals: list[Final] = []
    try:
        async for event in client.generate(PROMPT, request_id=request_id, **options):
            if isinstance(event, Chunk):
                tokens.setdefault(event.index, []).extend(event.token_ids)
                reasons[event.index] = event.finish_reason
            else:
                finals.append(event)
    except grpc.aio.AioRpcError as error:
        return tokens, reasons, finals, error
    return tokens, reasons, finals, None


def sample_0_stopped(engine: Engine, request_id: str) -> bool:
    request = engine.requests.get(request_id)
    return request is not None and request.sequences[0].finished


# ---------------------------------------------------------------------- endings


@pytest.mark.asyncio
async def test_samples_that_all_end_on_their_own_end_ok_with_every_finish_reason(
        target, two_samples):
    async with serving(target) as served, Client(served.address, max_retries=0) as client:
        completion = await client.complete(PROMPT, request_id="ok", **sampling(two_samples, 4))
    assert completion.finish_reasons == ["stop", "length"]
    assert completion.finish_reason == "stop"
    assert [s.token_ids for s in completion.samples] == [two_samples[0][:1], two_samples[1]]
    assert completion.token_ids == two_samples[0][:1]
    assert completion.usage.completion_tokens == 5 and completion.usage.prompt_tokens == 7
    assert completion.timings is not None and completion.timings.total_s >= 0


@pytest.mark.asyncio
async def test_a_timeout_that_cuts_one_of_two_samples_is_deadline_exceeded(target, two_samples):
    """Sample 0 stops at its first token; before the step after it, the
    request's timeout is made to pass, so sample 1 is cut with one token.
    The timeout is one no step reaches by itself (a short one could pass
    before the first step on a slow machine): the test moves the deadline
    the timeout set to now, as its passing would."""
    async with serving(target) as served, Client(served.address, max_retries=0) as client:
        engine = served.engine

        def pass_the_timeout() -> bool:
            request = engine.requests.get("cut")
            if request is not None and request.sequences[0].finished:
                assert request.deadline is not None  # from timeout_s
                request.deadline = min(request.deadline, time.monotonic())
            return False

        Gate(engine, pass_the_timeout)
        tokens, reasons, finals, error = await collect(
            client, "cut", timeout_s=UNREACHED_TIMEOUT_S, **sampling(two_samples, 400))
        assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "finish reasons by sample: stop, timeout" in error.details()
        assert finals == []  # a Final event means OK
        assert tokens == {0: two_samples[0][:1], 1: two_samples[1][:1]}
        assert reasons == {0: "stop", 1: "timeout"}
        # complete() raises the same status, with both samples as far as they came
        with pytest.raises(IncompleteError) as raised:
            await client.complete(PROMPT, request_id="cut", timeout_s=UNREACHED_TIMEOUT_S,
                                  **sampling(two_samples, 400))
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "finish reasons by sample: stop, timeout" in raised.value.details()
        partial = raised.value.completion
        assert partial.request_id == "cut"
        assert [s.token_ids for s in partial.samples] == [two_samples[0][:1],
                                                          two_samples[1][:1]]
        assert partial.finish_reasons == ["stop", "timeout"]
        assert partial.timings is None
    assert engine.pool.stats().in_use == 0


@pytest.mark.asyncio
async def test_an_abort_that_cuts_one_of_two_samples_ends_ok_as_for_one_sample(
        target, two_samples):
    """As a single-sample request aborted by the Abort RPC: OK, with a Final
    event; its finish_reasons tell which sample the abort cut."""
    async with serving(target) as served, Client(served.address, max_retries=0) as client:
        engine = served.engine
        gate = Gate(engine, lambda: sample_0_stopped(engine, "ab"))
        call = asyncio.ensure_future(collect(client, "ab", **sampling(two_samples, 400)))
        await gate.wait_held()  # sample 1 has its first token; this step makes its second
        assert await client.abort("ab")
        gate.open()
        tokens, reasons, finals, error = await call
    assert error is None
    assert tokens == {0: two_samples[0][:1], 1: two_samples[1][:2]}
    assert reasons == {0: "stop", 1: "abort"}
    assert [(f.finish_reason, f.finish_reasons) for f in finals] == [("stop", ["stop", "abort"])]
    assert finals[0].usage.completion_tokens == 3


@pytest.mark.asyncio
async def test_an_engine_fault_that_cuts_one_of_two_samples_is_internal(target, two_samples):
    async with serving(target) as served, Client(served.address, max_retries=0) as client:
        engine = served.engine
        verify = engine.executor.verifier.verify

        def faulty(scheduled, proposal):
            if sample_0_stopped(engine, "doomed"):
                raise RuntimeError("injected fault")
            return verify(scheduled, proposal)

        engine.executor.verifier.verify = faulty
        tokens, reasons, finals, error = await collect(
            client, "doomed", **sampling(two_samples, 400))
        assert error is not None and error.code() == grpc.StatusCode.INTERNAL
        assert "injected fault" in error.details()
        assert finals == []
        assert tokens == {0: two_samples[0][:1], 1: two_samples[1][:1]}
        assert reasons == {0: "stop", 1: "error"}
        engine.executor.verifier.verify = verify
        completion = await client.complete(PROMPT, **sampling(two_samples, 4))
        assert completion.finish_reasons == ["stop", "length"]
    assert engine.pool.stats().in_use == 0
    engine.pool.check_integrity()


@pytest.mark.asyncio
async def test_a_request_arrives_when_its_call_starts_not_after_tokenizing(target):
    """Queue and end-to-end times count from the start of the Generate call:
    the request's arrival is stamped before its prompt is prepared."""
    async with serving(target) as served, Client(served.address, max_retries=0) as client:
        engine = served.engine
        make_request = engine.make_request
        prepared: list[tuple[float, Request]] = []

        def recorded(*args: Any, **options: Any) -> Request:
            entered = time.monotonic()
            made = make_request(*args, **options)
            prepared.append((entered, made))
            return made

        engine.make_request = recorded  # type: ignore[method-assign]
        called = time.monotonic()
        completion = await client.complete(PROMPT, max_tokens=2, temperature=0.0)
    assert completion.finish_reason == "length"
    [(entered, made)] = prepared
    assert called <= made.arrival < entered
    assert made.timings.arrival == made.arrival


@pytest.mark.asyncio
async def test_a_fault_before_the_samples_fork_ends_each_of_them(target, two_samples):
    """Sample 1 forks at sample 0's first token; a fault in the first step
    ends it too, with a chunk of its own."""
    async with serving(target) as served, Client(served.address, max_retries=0) as client:
        engine = served.engine

        def faulty(scheduled, proposal):
            raise RuntimeError("injected fault")

        engine.executor.verifier.verify = faulty
        tokens, reasons, finals, error = await collect(
            client, "early", **sampling(two_samples, 400))
    assert error is not None and error.code() == grpc.StatusCode.INTERNAL
    assert (tokens, reasons, finals) == ({0: [], 1: []}, {0: "error", 1: "error"}, [])


@pytest.mark.asyncio
async def test_the_client_and_the_in_process_llm_return_the_same_completion(
        target, two_samples):
    from specpage.completion import Completion
    from specpage.core.request import ValidationError
    from specpage.llm import LLM

    llm = LLM(target, config=engine_config())
    [local] = llm.generate([PROMPT], SamplingParams(**sampling(two_samples, 4)))
    with pytest.raises(ValidationError, match="chat"):  # no tokenizer, so no chat template
        llm.generate(["hello"], chat=True)
    async with serving(target) as served, Client(served.address, max_retries=0) as client:
        remote = await client.complete(PROMPT, **sampling(two_samples, 4))
    assert isinstance(local, Completion) and isinstance(remote, Completion)
    assert local.samples == remote.samples
    assert local.finish_reasons == remote.finish_reasons == ["stop", "length"]
    assert local.usage.completion_tokens == remote.usage.completion_tokens == 5
    assert local.timings is not None and remote.timings is not None


# ---------------------------------------------------------------------- admission

MAX_NUM_SEQS, MAX_QUEUE, BURST = 2, 3, 24


async def burst(client: Client, first: int, admitted: list[asyncio.Task],
                refused: list[grpc.aio.AioRpcError], served: Served) -> None:
    """BURST concurrent calls; returns once each is admitted or refused."""
    calls = [asyncio.ensure_future(client.complete(
        PROMPT, request_id=f"b{first + i}", max_tokens=40, temperature=0.0, ignore_eos=True))
        for i in range(BURST)]
    known = len(served.async_engine.streams) + len(refused)
    end = time.monotonic() + GATE_TIMEOUT_S
    while True:
        for call in [c for c in calls if c.done()]:
            calls.remove(call)
            error = call.exception()
            assert isinstance(error, grpc.aio.AioRpcError), error
            refused.append(error)
        if len(served.async_engine.streams) + len(refused) == known + BURST:
            break
        assert time.monotonic() < end, "the burst was never answered"
        await asyncio.sleep(0.01)
    admitted += calls


@pytest.mark.asyncio
async def test_the_admission_bound_holds_while_a_step_is_in_flight(target):
    """max_num_seqs + max_queue = 5. The first request is taken by a step
    that is held; bursts of 24 then arrive while steps that took submissions
    are in flight. Exactly 5 are admitted, whatever the step in flight
    holds, and the engine never has more than max_queue waiting."""
    async with serving(target, MAX_NUM_SEQS, MAX_QUEUE) as served, \
            Client(served.address, max_retries=0) as client:
        gate = Gate(served.engine, lambda: True)
        admitted: list[asyncio.Task] = [asyncio.ensure_future(client.complete(
            PROMPT, request_id="b-first", max_tokens=40, temperature=0.0, ignore_eos=True))]
        refused: list[grpc.aio.AioRpcError] = []
        await gate.wait_held()  # the step in flight took the first request
        info = await client.server_info()
        assert (info.running, info.waiting) == (0, 0)  # the stats are from before it

        await burst(client, 0, admitted, refused, served)
        assert (len(admitted), len(refused)) == (5, BURST - 4)

        gate.allow()  # the first request runs; the next step takes the 4 and is held
        await gate.wait_held()
        assert not served.async_engine._submissions  # the held step took them
        await burst(client, 100, admitted, refused, served)
        assert (len(admitted), len(refused)) == (5, 2 * BURST - 4)

        gate.allow()  # 2 run, 3 wait
        await gate.wait_held()
        info = await client.server_info()
        assert (info.running, info.waiting) == (MAX_NUM_SEQS, MAX_QUEUE)
        await burst(client, 200, admitted, refused, served)
        assert (len(admitted), len(refused)) == (5, 3 * BURST - 4)

        for error in refused:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert int(dict(error.trailing_metadata())["retry-after-ms"]) >= 100
        gate.open()
        completions = await asyncio.gather(*admitted)
        assert [(len(c.token_ids), c.finish_reason) for c in completions] == [(40, "length")] * 5
        info = await client.server_info()
        assert (info.running, info.waiting, info.pool.in_use) == (0, 0, 0)
