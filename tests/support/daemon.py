"""A real daemon process on 127.0.0.1 for the tests, with tiny models."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.checkpoints import tiny_checkpoint
from tests.support.step_gate import ENV as GATE_ENV
from tests.support.step_gate import StepGate

REPO = Path(__file__).resolve().parents[2]


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before in this process:
    the OS may give a port just released to the next bind, so two ports
    asked for one after the other (a daemon's gRPC and metrics ports) could
    otherwise be the same."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def tiny_pair(folder: Path) -> tuple[Path, Path]:
    if not (folder / "target" / "config.json").is_file():
        tiny_checkpoint(folder / "target")
        tiny_checkpoint(folder / "draft", seed=1, num_hidden_layers=1)
    return folder / "target", folder / "draft"


class Daemon:
    """`python -m specpage serve` in a subprocess; stopped with SIGTERM.
    http=True serves the OpenAI-compatible API too, at http_url. gate=True
    puts a StepGate (open until a test closes it) before every engine step.
    without_triton=True runs it where triton cannot be imported."""

    def __init__(self, folder: Path, engine: str = "", server: str = "",
                 env: dict[str, str] | None = None, http: bool = False,
                 gate: bool = False, without_triton: bool = False) -> None:
        target, draft = tiny_pair(folder / "models")
        self.port = free_port()
        self.http_port = free_port() if http else None
        if self.http_port is not None:
            server += f"\nhttp_port = {self.http_port}\n"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.config = folder / f"specpage-{self.port}.toml"
        # fp32, as the in-process references the tests compare with: the
        # daemon's default (model.dtype = "auto") is bf16 on a CPU with native
        # bf16, and a tiny random model's greedy tokens differ between the two.
        self.config.write_text(
            f'[model]\ntarget = "{target}"\ndraft = "{draft}"\ndtype = "float32"\n'
            f"[engine]\nblock_size = 4\nnum_blocks = 512\nspec_k = 3\n{engine}\n"
            f'[server]\nhost = "127.0.0.1"\nport = {self.port}\n{server}\n'
        )
        self.log = folder / f"daemon-{self.port}.log"
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        command = "specpage"
        self.gate: StepGate | None = None
        if gate:
            self.gate = StepGate(folder / f"gate-{self.port}")
            environment[GATE_ENV] = str(self.gate.folder)
            command = "tests.support.step_gate"  # `specpage serve` behind the gate
        if without_triton:
            assert not gate, "one wrapper at a time"
            command = "tests.support.no_triton"
        self._terminated = False
        self._log_file = self.log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", command, "serve", "--config", str(self.config)],
            stdout=self._log_file, stderr=subprocess.STDOUT, env=environment,
            cwd=REPO if command.startswith("tests.") else None,  # where `tests` imports from
        )
        self.address = f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < end:
                assert self.process.poll() is None, self.log.read_text()
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"daemon not serving after {timeout} s:\n{self.log.read_text()}")

    def health(self) -> int:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=30).status)

    def terminate(self) -> None:
        """SIGTERM, once, as systemd stops a unit: `stop` then only waits."""
        if not self._terminated and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self._terminated = True

    def stop(self, timeout: float = 60.0) -> int:
        self.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            self._log_file.close()


def http_daemon(models: Path, gate: bool = False) -> Iterator[Daemon]:
    """A daemon with its HTTP front and metrics on, for a module's fixture."""
    process = Daemon(models, http=True, server=f"metrics_port = {free_port()}", gate=gate)
    process.wait_serving()
    yield process
    assert process.stop() == 0
