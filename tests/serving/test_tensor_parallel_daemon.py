"""A real daemon with engine.tensor_parallel_size = 2: a worker rank killed
mid-stream ends the daemon cleanly, within a bounded time: the stream in
flight gets INTERNAL, one error line names the rank, exit status 2."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import grpc

from specpage.client import generate_request
from specpage.serve.daemon import EXIT_ENGINE_FAILED
from specpage.serve.grpc_stubs import generation_pb2_grpc as pb_grpc
from tests.support.checkpoints import tiny_checkpoint
from tests.support.daemon import Daemon

VOCAB = 212  # divides by 2
EXIT_WITHIN = 30.0  # seconds from the kill to the daemon's exit


def workers(pid: int) -> list[int]:
    """The daemon's rank processes (spawned: their command line says so),
    whichever of its threads started them."""
    found = []
    children = [c for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(int(child))
    return found


def test_a_killed_worker_ends_the_daemon_with_status_2(tmp_path):
    models = tmp_path / "models"
    tiny_checkpoint(models / "target", vocab_size=VOCAB)
    tiny_checkpoint(models / "draft", seed=1, num_hidden_layers=1, vocab_size=VOCAB)
    daemon = Daemon(tmp_path, engine="tensor_parallel_size = 2", gate=True)
    gate = daemon.gate
    assert gate is not None
    try:
        daemon.wait_serving()
        [worker] = workers(daemon.process.pid)
        gate.close()  # the stream is still in flight when its worker is killed
        first_chunk, outcome = threading.Event(), {}

        def stream() -> None:
            with grpc.insecure_channel(daemon.address) as channel:
                call = pb_grpc.GenerationStub(channel).Generate(generate_request(
                    [5, 6, 7], max_tokens=400, temperature=0.0, ignore_eos=True))
                try:
                    for _ in call:
                        first_chunk.set()
                except grpc.RpcError as error:
                    outcome["code"], outcome["details"] = error.code(), error.details()
                first_chunk.set()

        client = threading.Thread(target=stream)
        client.start()
        asyncio.run(gate.wait_held())
        gate.allow()  # the prefill: the first token
        assert first_chunk.wait(60)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        gate.open()  # the next step finds the worker gone
        status = daemon.process.wait(EXIT_WITHIN)
        assert time.monotonic() - killed < EXIT_WITHIN
        client.join(10)
    finally:
        gate.open()
        daemon.stop()
    assert status == EXIT_ENGINE_FAILED
    assert outcome["code"] == grpc.StatusCode.INTERNAL
    assert "engine fault" in outcome["details"]
    lines = [json.loads(line) for line in daemon.log.read_text().splitlines()
             if line.startswith("{")]
    failed = [line for line in lines if "tensor parallelism failed" in line.get("msg", "")]
    assert len(failed) == 1, failed
    assert f"specpage-rank-1 (pid {worker}) exited with status -9" in failed[0]["msg"]
    assert failed[0]["level"] == "error"
    assert any(line.get("msg") == "draining" for line in lines)
