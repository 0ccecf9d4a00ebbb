"""A rank other than 0: load its shard, join the groups, run what rank 0 says.

Local workers are started by rank 0 (`ranks.start_workers`); they load
their shard before joining the groups and report over a pipe that it
loaded, or why not, so a checkpoint a worker cannot read fails the start-up
with its message instead of leaving rank 0 waiting at the rendezvous. A
rank on another machine runs this module (`python -m
specpage.executor.parallel.worker`) with torch's env:// variables set.

A worker exits when rank 0 says stop (status 0), and when rank 0 is gone
or a collective fails (status 1, the error on stderr).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from specpage.executor.model_runner import ModelRunner
from specpage.executor.parallel.comm import Collectives, Ranks
from specpage.executor.parallel.sharding import load_shard

LOADED = "loaded"  # what a local worker sends over its pipe once its shard is built


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to know: where the ranks meet, its model and KV."""

    rank: int
    world: int
    init_method: str
    folder: str
    dtype: str  # the target's, e.g. "float32"
    device: str  # this rank's, e.g. "cpu" or "cuda:1"
    num_blocks: int
    block_size: int
    threads: int  # torch intra-op threads; ranks on one machine share its cores


def run(spec: WorkerSpec, report: Connection | None = None) -> int:
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    collectives = Collectives(spec.rank, spec.world)
    try:
        shard = load_shard(Path(spec.folder), spec.dtype, device, collectives)
        runner = ModelRunner(shard, spec.num_blocks, spec.block_size)
    except Exception as error:
        if report is not None:
            report.send(f"rank {spec.rank}: {error}")
        raise
    if report is not None:
        report.send(LOADED)
    ranks = Ranks(spec.rank, spec.world, spec.init_method, device)
    serve(ranks, runner)
    ranks.close()
    return 0


def serve(ranks: Ranks, runner: ModelRunner) -> None:
    """Run commands until rank 0 says stop."""
    while True:
        command = ranks.receive()
        if command.stop:
            return
        runner.copy_blocks(command.copies)
        if command.spans:
            runner.forward(command.spans)


def spawned(spec: WorkerSpec, report: Connection) -> None:
    """The entry of a worker process that rank 0 started."""
    sys.exit(run(spec, report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specpage.executor.parallel.worker",
        description="one rank of a tensor-parallel specpage engine on another machine; "
                    "MASTER_ADDR and MASTER_PORT name rank 0's machine")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True,
                        help="engine.tensor_parallel_size")
    parser.add_argument("--model", required=True, help="the target's folder on this machine")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-blocks", type=int, required=True, help="engine.num_blocks")
    parser.add_argument("--block-size", type=int, required=True, help="engine.block_size")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    return run(WorkerSpec(args.rank, args.world_size, "env://", args.model, args.dtype,
                          args.device, args.num_blocks, args.block_size, args.threads))


if __name__ == "__main__":
    sys.exit(main())
