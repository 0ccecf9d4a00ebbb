"""The process groups of a tensor-parallel engine and what travels over them.

Two groups span the same ranks. The compute group (NCCL on CUDA, gloo on
CPU) carries the shards' all-reduces and the logits' gather; its timeout is
short, because ranks meet at every layer and one that stops answering must
fail the step, not hang it. The command group (gloo, tensors on the CPU)
carries rank 0's commands; a worker waits there for as long as the engine
is idle, so its timeout is the longest torch accepts in practice. A rank
that dies closes its sockets, and the others' pending operations fail at
once (gloo: "Connection closed by peer"), in either group.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import msgspec
import torch
import torch.distributed as dist

from specpage.core.span import Span

# A rank waits this long at an all-reduce for the others; they reach it
# within a layer's compute of one another, milliseconds, or seconds on a
# machine shared with other work. Gloo's default is 30 minutes.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)
# A worker waits for the next command while the engine has no work: days.
IDLE_TIMEOUT = datetime.timedelta(days=3650)
# Environment variables of torch's env:// rendezvous (MASTER_PORT, WORLD_SIZE
# and RANK go with it); when MASTER_ADDR is set, ranks meet there.
RENDEZVOUS_ADDRESS = "MASTER_ADDR"


class Command(msgspec.Struct, frozen=True, array_like=True):
    """What rank 0 tells the workers: copy these blocks, then run the target's
    forward over these spans (none: only the copies); stop ends the worker."""

    spans: list[Span] = []
    copies: list[tuple[int, int]] = []
    stop: bool = False


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Command)


def rendezvous() -> str:
    """env:// when its variables are set (ranks on other machines can join),
    else a free port on loopback."""
    if os.environ.get(RENDEZVOUS_ADDRESS):
        return "env://"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Collectives:
    """The compute group's (the default group's) operations that the shards
    call, timed: the seconds spent in them (waiting for slower ranks
    included) are the communication cost of a step."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.seconds = 0.0  # in all-reduces and gathers, since start

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks: x itself, summed in place, when contiguous; else
        a contiguous copy (a collective reads the tensor's memory in order,
        and a few-row projection returns a transposed view)."""
        start = time.perf_counter()
        x = x.contiguous()
        dist.all_reduce(x)
        self.seconds += time.perf_counter() - start
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's x side by side, rank order ([rows, world * cols]).
        Other ranks: x itself (only rank 0 samples)."""
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0)
        self.seconds += time.perf_counter() - start
        return x if parts is None else torch.cat(parts, dim=-1)


class Ranks:
    """This process's membership in a tensor-parallel engine's groups."""

    def __init__(self, rank: int, world: int, init_method: str, device: torch.device) -> None:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world, timeout=COLLECTIVE_TIMEOUT)
        self.commands = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.rank, self.world = rank, world

    def send(self, command: Command) -> None:
        """Rank 0: broadcast a command to every worker."""
        payload = torch.frombuffer(bytearray(_encoder.encode(command)), dtype=torch.uint8)
        dist.broadcast(torch.tensor([payload.numel()]), 0, group=self.commands)
        dist.broadcast(payload, 0, group=self.commands)

    def receive(self) -> Command:
        """A worker: the next command (waits while the engine is idle)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.commands)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(payload, 0, group=self.commands)
        return _decoder.decode(payload.numpy().tobytes())

    def close(self) -> None:
        dist.destroy_process_group()
