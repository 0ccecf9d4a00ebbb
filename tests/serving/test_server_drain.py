"""A request still running when the daemon stops ends UNAVAILABLE after the
chunks it produced: a cut output is never reported as a complete one."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specpage.client import Chunk, Client, Final
from tests.serving.test_server_streams import PROMPT, Gate, serving, target  # noqa: F401 (fixture)


@pytest.mark.asyncio
async def test_a_request_cut_by_the_stop_ends_unavailable_after_its_chunks(target):  # noqa: F811
    async with serving(target) as served, Client(served.address, max_retries=0) as client:
        # The prefill runs; the step after it waits until the stop has begun,
        # so the request cannot end on its own before the stop cuts it.
        gate = Gate(served.engine, lambda: True)
        gate.allow()
        tokens: list[int] = []
        reasons: list[str | None] = []
        finals: list[Final] = []
        stopping: asyncio.Task[None] | None = None
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for event in client.generate(PROMPT, max_tokens=400, temperature=0.0,
                                               ignore_eos=True, spec="off"):
                if isinstance(event, Chunk):
                    tokens += event.token_ids
                    reasons.append(event.finish_reason)
                    if stopping is None:  # the drain's grace is over: stop aborts it
                        stopping = asyncio.create_task(served.async_engine.stop())
                        # its abort is queued before the steps let go could
                        # deliver: at most two run ahead of the event loop
                        gate.open()
                else:
                    finals.append(event)
        assert stopping is not None
        await stopping
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "stopped before request" in (raised.value.details() or "")
        assert finals == []
        assert 1 <= len(tokens) < 400
        assert reasons[-1] == "abort"
        served.engine.pool.check_integrity()
        assert served.engine.pool.stats().in_use == 0
