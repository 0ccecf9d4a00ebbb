"""Prompts are tokenized by a pool of PREPARE_CONCURRENCY threads of their
own: a client that cancels each call while its prompt is being tokenized
cannot keep more of them busy (the work of a cancelled call runs on, so a
semaphore released on cancel would let it start any number)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from specpage.client import Client
from specpage.engine import Engine, EngineConfig
from specpage.frontend import PREPARE_CONCURRENCY, Frontend
from specpage.models.loader import load_model
from tests.inprocess_util import serving_engine
from tests.models_util import tiny_checkpoint

CALLS = PREPARE_CONCURRENCY + 4
STARTED_WAIT_S = 0.5  # how long a call may take to start preparing (only the test's pace)
RELEASE_TIMEOUT_S = 60.0  # a prepare that is never released fails the test


class BlockingPrepare:
    """Wraps the front end's prepare step: each one blocks until released and
    the most running at once is counted."""

    def __init__(self, frontend: Frontend) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()
        prepare = frontend._make_request

        def blocking(*args: object) -> object:
            with self._lock:
                self.running += 1
                self.most = max(self.most, self.running)
            self.started.release()
            try:
                assert self.release.wait(RELEASE_TIMEOUT_S)
                return prepare(*args)  # type: ignore[arg-type]
            finally:
                with self._lock:
                    self.running -= 1

        frontend._make_request = blocking  # type: ignore[method-assign]


@pytest.mark.asyncio
async def test_calls_cancelled_while_tokenizing_cannot_start_more_tokenizers(tmp_path: Path):
    tiny_checkpoint(tmp_path / "target")
    engine = Engine(load_model(tmp_path / "target"), None, None,
                    EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4))
    async with serving_engine(engine) as served:
        prepare = BlockingPrepare(served.service.frontend)
        try:
            await cancel_while_preparing(served.address, prepare)
        finally:
            prepare.release.set()


async def cancel_while_preparing(address: str, prepare: BlockingPrepare) -> None:
    async with Client(address, max_retries=0) as client:
        for i in range(CALLS):
            call = asyncio.create_task(client.complete([1, 2, 3], max_tokens=2,
                                                       request_id=f"r{i}"))
            # cancelled once its prompt is being prepared, or after a while
            # if none of the pool's threads is free to take it
            await asyncio.to_thread(prepare.started.acquire, True, STARTED_WAIT_S)
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
