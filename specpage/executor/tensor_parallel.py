"""The executor with the target split over ranks (specpage.executor.parallel).

Rank 0, in this process, runs what `Executor` runs: the draft (whole), the
target's first shard and the verifier, which samples from the logits the
shards gather here. Before each target forward it sends the workers the
forward's spans (the scheduled tokens with the draft's proposals appended)
and the block copies since the last one; they run the same forward on their
shards and the all-reduces keep every rank in step. A forward timed at
start-up for the speculation policy goes the same way, so the ranks join it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specpage.core.config_error import ConfigError
from specpage.core.engine_config import EngineConfig
from specpage.core.span import Span
from specpage.executor.executor import Executor
from specpage.executor.model_runner import ModelRunner
from specpage.executor.parallel.comm import Collectives, Command, Ranks, rendezvous
from specpage.executor.parallel.ranks import Workers, local_world, threads_per_rank
from specpage.executor.parallel.sharding import check_divisible, shard_loaded
from specpage.executor.parallel.worker import WorkerSpec
from specpage.models.loader import LoadedModel

log = logging.getLogger("specpage.engine")
# Seconds a failed collective waits for a worker's exit to explain it: a
# killed process's sockets close before the kernel reaps it.
DEATH_NOTICE = 1.0


class LeaderRunner(ModelRunner):
    """Rank 0's shard of the target: each forward is sent to the workers
    first; block copies go with the next forward."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, ranks: Ranks,
                 workers: Workers) -> None:
        super().__init__(loaded, config.num_blocks, config.block_size)
        self.ranks, self.workers = ranks, workers
        self._copies: list[tuple[int, int]] = []  # not yet sent

    def forward(self, spans: Sequence[Span], *args: Any, **kwargs: Any) -> torch.Tensor:
        self.check(spans)  # a bad span fails here alone, before any rank runs it
        if self.workers.fault is not None:
            raise RuntimeError(f"tensor parallelism failed: {self.workers.fault}")
        command = Command(list(spans), self._copies)
        try:
            self.ranks.send(command)
            self._copies = []
            return super().forward(spans, *args, **kwargs)
        except RuntimeError as error:  # a collective failed: the ranks are out of step
            # Most often because a worker died, which its sentinel tells in a moment.
            self.workers.failed(self.workers.death(DEATH_NOTICE)
                                or f"a collective failed: {error}")
            raise RuntimeError(f"tensor parallelism failed: {self.workers.fault}") from error

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        super().copy_blocks(copies)
        self._copies += copies


# The families whose layers a shard splits: sharding.py splits the Llama
# shape's projections only (not q/k norms, nor Gemma's scaled embedding).
SHARDED_FAMILIES = ("llama", "qwen2")


class TensorParallelExecutor(Executor):
    """`Executor` with config.tensor_parallel_size ranks for the target."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None,
                 config: EngineConfig) -> None:
        world = config.tensor_parallel_size
        check_divisible(target.config, world)
        if target.config.family not in SHARDED_FAMILIES:
            raise ConfigError(f"engine.tensor_parallel_size > 1 is not implemented for "
                              f"{target.config.architecture} ({target.folder}); it takes "
                              f"the families {', '.join(SHARDED_FAMILIES)}")
        if draft is not None and not isinstance(draft, LoadedModel):
            # a draft head reads the target's embedding, which the ranks split
            raise ConfigError("engine.tensor_parallel_size > 1 takes a draft model, "
                              f"not a draft head ({draft.folder})")
        device = target.model.embed_tokens.weight.device
        self._threads = torch.get_num_threads()  # given back on close
        threads = threads_per_rank(world, self._threads)
        torch.set_num_threads(threads)
        init_method = rendezvous()
        dtype = str(target.model.embed_tokens.weight.dtype).removeprefix("torch.")
        self.workers = Workers([
            WorkerSpec(rank, world, init_method, str(target.folder), dtype,
                       f"cuda:{rank}" if device.type == "cuda" else "cpu",
                       config.num_blocks, config.block_size, threads)
            for rank in range(1, local_world(world))])
        try:
            self.ranks = Ranks(0, world, init_method, device)
            self.collectives = Collectives(0, world)
            shard = shard_loaded(target, self.collectives)
            runner = LeaderRunner(shard, config, self.ranks, self.workers)
            super().__init__(shard, draft, config, target_runner=runner)
        except BaseException:
            self.workers.stop_watching()
            self.workers.join(grace=0.0)
            raise
        log.info("tensor parallelism: %d ranks, %d here, %d torch threads each",
                 world, local_world(world), threads)

    def on_fault(self, handler: Callable[[str], None]) -> None:
        self.workers.on_fault(handler)

    def close(self) -> None:
        """Tell the workers to stop, wait for them, leave the groups."""
        torch.set_num_threads(self._threads)
        self.workers.stop_watching()
        if self.workers.fault is not None:  # the ranks are out of step: end the rest
            self.workers.join(grace=0.0)
            return
        self.ranks.send(Command(stop=True))
        self.workers.join()
        self.ranks.close()
