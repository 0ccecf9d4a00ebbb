"""The asyncio bridge's request streams: merging for slow readers, ordering."""

import asyncio
import time

import pytest

from specpage.core.request import Timings, Usage
from specpage.engine import RequestOutput
from specpage.engine.async_engine import Chunk, Final, RequestStream


def output(tokens, total, finished=False, usage=False):
    return RequestOutput("r", 0, tokens, "".join(map(str, tokens)), total, finished=finished,
                         finish_reason="length" if finished else None,
                         usage=Usage() if usage else None, timings=Timings() if usage else None)


@pytest.mark.asyncio
async def test_a_slow_reader_gets_merged_chunks_and_the_final_last():
    stream = RequestStream("r")
    stream.push(output([1], 1))
    stream.push(output([2, 3], 3))
    events = stream.events()
    first = await anext(events)
    assert (first.token_ids, first.num_tokens, first.text) == ([1, 2, 3], 3, "123")
    # while the reader is busy with that chunk, the rest arrives at once
    stream.push(output([4], 4))
    stream.push(output([5], 5, finished=True, usage=True))
    rest = [event async for event in events]
    assert isinstance(rest[-1], Final)
    chunks = [e for e in rest if isinstance(e, Chunk)]
    assert [t for c in chunks for t in c.token_ids] == [4, 5]
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_tokens == 5


@pytest.mark.asyncio
async def test_chunks_pushed_during_a_yield_are_not_lost():
    stream = RequestStream("r")
    stream.push(output([1], 1))
    seen = []
    async for event in stream.events():
        seen.append(event)
        if len(seen) == 1:  # the reader is suspended here, as on a slow send
            stream.push(output([2], 2))
            stream.push(output([3], 3, finished=True, usage=True))
            await asyncio.sleep(0)
    tokens = [t for e in seen if isinstance(e, Chunk) for t in e.token_ids]
    assert tokens == [1, 2, 3] and isinstance(seen[-1], Final)


@pytest.mark.asyncio
async def test_stop_is_bounded_even_when_the_engine_never_answers(tmp_path):
    """A stream the engine never ends is failed at stop, not waited on forever."""
    from specpage.engine import Engine, EngineConfig
    from specpage.engine.async_engine import AsyncEngine, DrainingError
    from specpage.models.loader import load_model
    from tests.support.checkpoints import tiny_checkpoint

    tiny_checkpoint(tmp_path)
    engine = Engine(load_model(tmp_path), None, None, EngineConfig(block_size=4, num_blocks=64))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    stream = RequestStream("lost")  # known to the bridge, never submitted to the engine
    async_engine.streams["lost"] = stream
    # stop's own bound is 0.2 s; 60 s only tells a bounded stop from one that waits forever
    await asyncio.wait_for(async_engine.stop(timeout=0.2), timeout=60)
    with pytest.raises(DrainingError):
        async for _ in stream.events():
            pass


@pytest.mark.asyncio
async def test_the_queue_bound_counts_only_requests_that_must_wait(tmp_path):
    """With one running place and max_queue 2, three requests that arrive
    before any step are all admitted (one will run, two wait); a fourth is
    refused. Whether the engine has stepped in between must not matter."""
    from specpage.core.request import Request, SamplingParams
    from specpage.engine import Engine, EngineConfig
    from specpage.engine.async_engine import AsyncEngine, QueueFullError
    from specpage.models.loader import load_model
    from tests.support.checkpoints import tiny_checkpoint

    tiny_checkpoint(tmp_path)
    engine = Engine(load_model(tmp_path), None, None,
                    EngineConfig(block_size=4, num_blocks=64, max_num_seqs=1))
    async_engine = AsyncEngine(engine, max_queue=2)  # not started: no step runs

    def request(i):
        # ignore_eos: a sampled end of text would finish the running one
        return Request(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=4, ignore_eos=True))

    for i in range(3):
        async_engine.submit(request(i))
    assert async_engine.num_queued == 2
    with pytest.raises(QueueFullError):
        async_engine.submit(request(3))
    # after a step the engine holds them: the same answer
    async_engine._stats = await asyncio.to_thread(lambda: async_engine._step()[1])
    assert (async_engine._stats.running, async_engine._stats.waiting) == (1, 2)
    assert async_engine.num_queued == 2
    with pytest.raises(QueueFullError):
        async_engine.submit(request(3))
    await async_engine.stop(timeout=1)


@pytest.mark.asyncio
async def test_samples_hold_their_running_places_from_admission(tmp_path):
    """A request of n samples holds n running places (it forks into n) from
    the moment it is admitted, and gives one back as each sample ends."""
    from specpage.core.request import Request, SamplingParams
    from specpage.engine import Engine, EngineConfig
    from specpage.engine.async_engine import AsyncEngine, QueueFullError
    from specpage.models.loader import load_model
    from tests.support.checkpoints import tiny_checkpoint

    tiny_checkpoint(tmp_path)
    engine = Engine(load_model(tmp_path), None, None,
                    EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4))
    async_engine = AsyncEngine(engine, max_queue=2)  # not started: no step runs

    def request(name, n):
        return Request(name, (1, 2, 3), SamplingParams(max_tokens=4, n=n))

    async_engine.submit(request("four", 4))
    assert async_engine.num_queued == 0  # it will start at the next step
    async_engine.submit(request("two", 2))
    assert async_engine.num_queued == 2
    with pytest.raises(QueueFullError):
        async_engine.submit(request("one", 1))
    # sample 3 of the first request ends: its place is free for the third
    async_engine.streams["four"].push(RequestOutput("four", 3, [], "", 0, finished=True,
                                                    finish_reason="stop"))
    assert async_engine.num_queued == 1
    async_engine.submit(request("one", 1))
    assert async_engine.num_queued == 2
    await async_engine.stop(timeout=1)


@pytest.mark.asyncio
async def test_a_fault_while_submitting_leaves_no_request_behind(tmp_path):
    """The engine refuses the second of three submissions. Every request in
    flight fails with the fault, none of them lingers in the engine or the
    submissions, and a client retrying the same ids gets complete answers."""
    from specpage.core.request import Request, SamplingParams
    from specpage.engine import Engine, EngineConfig
    from specpage.engine.async_engine import AsyncEngine, EngineFaultError
    from specpage.models.loader import load_model
    from tests.support.checkpoints import tiny_checkpoint

    tiny_checkpoint(tmp_path)
    engine = Engine(load_model(tmp_path), None, None, EngineConfig(block_size=4, num_blocks=64))
    submit = engine.submit

    def refuse_r1(request):
        if request.request_id == "r1":
            raise RuntimeError("no room for r1")
        submit(request)

    engine.submit = refuse_r1
    async_engine = AsyncEngine(engine)

    def request(i, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return Request(f"r{i}", (1, 2, 3), params)

    streams = [async_engine.submit(request(i, 100)) for i in range(3)]  # before any step
    async_engine.start()
    for stream in streams:
        with pytest.raises(EngineFaultError, match="no room for r1"):
            async for _ in stream.events():
                pass
    assert not async_engine._submissions
    engine.submit = submit
    for i in range(3):
        events = [e async for e in async_engine.submit(request(i, 4)).events()]
        assert events[-1].finish_reasons == ["length"]
    assert not engine.requests and not async_engine.streams
    await async_engine.stop(timeout=1)


@pytest.mark.asyncio
async def test_submissions_behind_waiting_sequences_count_each_sample(tmp_path):
    """While a sequence waits for blocks, a pending request of two samples
    adds two queued places, not one."""
    from specpage.core.request import Request, SamplingParams
    from specpage.engine import Engine, EngineConfig
    from specpage.engine.async_engine import AsyncEngine
    from specpage.models.loader import load_model
    from tests.support.checkpoints import tiny_checkpoint

    tiny_checkpoint(tmp_path)
    engine = Engine(load_model(tmp_path), None, None,
                    EngineConfig(block_size=4, num_blocks=6, max_num_seqs=8))
    async_engine = AsyncEngine(engine)  # not started: steps run by hand
    long_prompt = tuple(range(1, 17))  # 4 of the 6 blocks: two cannot run at once
    for name in ("first", "second"):
        async_engine.submit(Request(name, long_prompt,
                                    SamplingParams(max_tokens=4, ignore_eos=True)))
    async_engine._stats = await asyncio.to_thread(lambda: async_engine._step()[1])
    assert (async_engine._stats.running, async_engine._stats.waiting) == (1, 1)
    assert async_engine.num_queued == 1
    async_engine.submit(Request("pair", (1, 2, 3), SamplingParams(max_tokens=4, n=2)))
    assert async_engine.num_queued == 3  # the waiting sequence and both samples
    await async_engine.stop(timeout=1)


@pytest.mark.asyncio
async def test_the_engine_is_built_and_stepped_on_one_thread(tmp_path):
    """torch runs on one thread only: the engine built on step_thread() is
    stepped there, and the step thread runs ahead of the event loop without
    losing or reordering a token."""
    import threading

    from specpage.core.request import Request, SamplingParams
    from specpage.engine import Engine, EngineConfig
    from specpage.engine.async_engine import AsyncEngine, step_thread
    from specpage.models.loader import load_model
    from tests.support.checkpoints import tiny_checkpoint

    tiny_checkpoint(tmp_path)
    thread = step_thread()
    loop = asyncio.get_running_loop()

    def build():
        return threading.get_ident(), Engine(load_model(tmp_path), None, None,
                                             EngineConfig(block_size=4, num_blocks=64))

    built_on, engine = await loop.run_in_executor(thread, build)
    stepped_on = set()
    step = engine.step

    def recorded_step():
        stepped_on.add(threading.get_ident())
        return step()

    engine.step = recorded_step
    async_engine = AsyncEngine(engine, thread=thread)
    async_engine.start()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    streams = [async_engine.submit(Request(f"r{i}", (1, 2, 3 + i), params)) for i in range(3)]
    for stream in streams:
        events = [e async for e in stream.events()]
        tokens = [t for e in events[:-1] for t in e.token_ids]
        assert len(tokens) == 24 and events[-1].finish_reasons == ["length"]
    await async_engine.stop(timeout=1)
    assert stepped_on == {built_on}
    thread.shutdown()


@pytest.mark.asyncio
async def test_a_failure_outside_the_step_fails_the_streams(tmp_path):
    """A bug that ends the step thread's loop itself (not a step) fails every
    open stream and stops admission, rather than leaving them waiting."""
    from specpage.core.request import Request, SamplingParams
    from specpage.engine import Engine, EngineConfig
    from specpage.engine.async_engine import AsyncEngine, DrainingError, EngineFaultError
    from specpage.models.loader import load_model
    from tests.support.checkpoints import tiny_checkpoint

    tiny_checkpoint(tmp_path)
    engine = Engine(load_model(tmp_path), None, None, EngineConfig(block_size=4, num_blocks=64))

    def broken():
        raise RuntimeError("has_unfinished broke")

    engine.has_unfinished = broken
    async_engine = AsyncEngine(engine)
    stream = async_engine.submit(Request("r", (1, 2, 3), SamplingParams(max_tokens=4)))
    async_engine.start()
    with pytest.raises(EngineFaultError, match="has_unfinished broke"):
        async for _ in stream.events():
            pass
    end = time.monotonic() + 60  # a bound on a hang, not a guess at the speed
    while not async_engine.draining and time.monotonic() < end:
        await asyncio.sleep(0.01)  # the step's own fault handling comes first, then the loop ends
    with pytest.raises(DrainingError):
        async_engine.submit(Request("s", (1, 2, 3), SamplingParams(max_tokens=4)))
    await async_engine.stop(timeout=1)
