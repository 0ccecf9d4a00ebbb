"""The executor: the models' side of the step's value boundary.

It owns the model runners (their KV tensors), the draft proposer and the
verifier, and turns a `StepBatch` into a `StepResult`. It never sees a
`Sequence` or the pool: what it needs arrives as plain values, and what it
measured (forward costs) goes back in the result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from specpage.core.engine_config import EngineConfig
from specpage.core.layer_groups import LayerGroups
from specpage.core.step import StepBatch, StepResult
from specpage.executor.head_runner import HeadRunner
from specpage.executor.model_runner import ModelRunner
from specpage.models.eagle3 import LoadedHead
from specpage.models.loader import LoadedModel
from specpage.speculation import cost_cache
from specpage.speculation.calibrate import Plan, calibration_sizes, measure
from specpage.speculation.draft_proposer import DraftProposer
from specpage.speculation.head_proposer import HeadProposer
from specpage.speculation.proposal import Guides, Proposal, Proposer, with_masks
from specpage.speculation.verifier import Verifier

log = logging.getLogger("specpage.engine")


Built = tuple[ModelRunner | HeadRunner, Proposer, tuple[int, ...]]


def _draft_model(target: LoadedModel, draft: Any, config: EngineConfig) -> Built:
    runner = ModelRunner(draft, config.num_blocks, config.block_size,
                         graphs_for=config.max_num_seqs if config.cuda_graphs else 0,
                         max_context=config.max_context)
    return runner, DraftProposer(runner, config.deterministic), ()


def _head(target: LoadedModel, draft: Any, config: EngineConfig) -> Built:
    # the head reads the target's hidden states (at feature layers) and embedding
    runner = HeadRunner(draft, target.model.embed_tokens, config.num_blocks, config.block_size)
    layers = draft.config.layers_of(target.config.num_layers)
    return runner, HeadProposer(runner, config.deterministic), layers


# The runner, proposer and target layers each kind of loaded draft needs.
PROPOSERS: dict[type, Callable[[LoadedModel, Any, EngineConfig], Built]] = {
    LoadedModel: _draft_model, LoadedHead: _head}


class Executor:
    def __init__(self, target: LoadedModel, draft: LoadedModel | LoadedHead | None,
                 config: EngineConfig, target_runner: ModelRunner | None = None,
                 groups: LayerGroups | None = None) -> None:
        # target_runner: one built already (tensor parallelism: rank 0's shard);
        # groups: the target's KV in pages of a layer group (core/layer_groups.py)
        count = 1 if groups is None else len(groups.windows)
        self.target = target_runner or ModelRunner(
            target, config.num_blocks * count, config.block_size,
            deterministic=config.deterministic,
            graphs_for=config.max_num_seqs if config.cuda_graphs else 0,
            max_context=config.max_context, groups=groups)
        self.runners: list[ModelRunner | HeadRunner] = [self.target]
        self.draft: ModelRunner | HeadRunner | None = None
        self.proposer: Proposer | None = None
        feature_layers: tuple[int, ...] = ()
        if draft is not None:
            self.draft, self.proposer, feature_layers = PROPOSERS[type(draft)](
                target, draft, config)
            self.runners.append(self.draft)
        self.verifier = Verifier(self.target, feature_layers, coupled=config.deterministic)
        self._identities = (target.identity, draft.identity if draft else b"")

    def execute(self, batch: StepBatch, guides: Guides | None = None) -> StepResult:
        """guides: the grammar of each constrained sequence the draft may
        propose for, by seq_id (speculation/proposal.py), from the core in
        this process."""
        start = time.perf_counter()
        for runner in self.runners:
            runner.copy_blocks(batch.copies)
        if self.proposer is None or not batch.seqs:
            proposal = Proposal.none(len(batch.seqs))
        else:
            proposal = self.proposer.propose(batch.seqs, guides or {})
        proposal = proposal.with_core(batch.seqs)
        verdict = self.verifier.verify(with_masks(batch.seqs, proposal, guides or {}), proposal)
        results, costs = verdict.results, proposal.costs
        if self.proposer is not None and batch.seqs:
            results, absorbed = self.proposer.absorb(batch.seqs, proposal, verdict)
            costs = costs + absorbed
        return StepResult(results, verdict.cost, costs, time.perf_counter() - start)

    def on_fault(self, handler: Callable[[str], None]) -> None:
        """Call handler(reason) from another thread if the executor fails
        beyond recovery; in one process a failure is a step's exception."""

    def close(self) -> None:
        """Give back what the executor started (tensor parallelism: its ranks)."""

    def measure_costs(self, config: EngineConfig,
                      max_context: int) -> cost_cache.CachedCosts:
        """Both models' forward costs over the sizes a step can verify, for
        the speculation policy (speculation/calibrate.py), or what an earlier start
        measured on this machine (speculation/cost_cache.py); the target's alone
        without a draft (model-free proposals cost only its positions)."""
        c, start = config, time.perf_counter()
        k = max(c.spec_k if self.draft is not None else 0, c.model_free_k)
        sizes = calibration_sizes(min(c.max_step_tokens, c.max_num_seqs * (k + 1)))
        plan = Plan.make(sizes, c.max_num_seqs, c.num_blocks, max_context)
        graphs = any(getattr(runner, "graphs", None) is not None for runner in self.runners)
        path = cost_cache.cache_path(self._identities, plan, self.target.dtype, c.block_size,
                                     graphs)
        costs, source = cost_cache.load(path), "read from " + str(path)
        if costs is None:
            source = "measured"
            runners = [(self.target, True)] + ([(self.draft, False)] if self.draft else [])
            measured = measure(runners, plan)
            costs = cost_cache.CachedCosts(*(m.points() for m in measured),
                                           *([[]] if self.draft is None else []))
            if all(len(m) == len(sizes) for m in measured):
                cost_cache.store(path, costs)
        log.info("speculation costs %s (%d and %d sizes) in %.1f s", source,
                 len(costs.target), len(costs.draft), time.perf_counter() - start)
        return costs
