"""The engine: requests in, token deltas out, one step at a time.

It wires the two sides of a step together. The core (core/engine_core.py:
requests, scheduler, pool, policy; no torch) schedules a `StepBatch`; the
executor (executor/executor.py: the models) turns it into a `StepResult`; the
core applies that. Synchronous and single-threaded; the daemon runs it off
its event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from specpage.core.block_pool import BlockPool
from specpage.core.engine_config import EngineConfig
from specpage.core.engine_core import EngineCore, EngineStats
from specpage.core.grammar import Constraint
from specpage.core.intake import Intake
from specpage.core.layer_groups import GroupedPool, LayerGroups, Pool, layer_groups
from specpage.core.outputs import RequestOutput
from specpage.core.policy import SpecPolicy
from specpage.core.proposer_rules import DRAFT_MODEL, HEAD, NO_MODEL
from specpage.core.request import Request, SamplingParams
from specpage.core.scheduler import Scheduler
from specpage.executor.executor import Executor
from specpage.executor.tensor_parallel import TensorParallelExecutor
from specpage.models.corpus import corpus_table
from specpage.models.eagle3 import LoadedHead
from specpage.models.loader import (
    LoadedModel,
    ModelLoadError,
    check_draft_compatible,
    check_head_compatible,
    draft_vocabulary,
)
from specpage.speculation.calibrate import fit_segments

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestOutput"]

log = logging.getLogger("specpage.engine")


def hybrid_groups(target: LoadedModel, draft: object, config: EngineConfig,
                  max_context: int) -> LayerGroups | None:
    """The target's layer groups where its sliding-window layers keep
    tables of their own (EngineConfig.hybrid_kv), else None: no such layers
    or none whose window is shorter than the context, a draft model or head
    (their KV shares the pool's block ids), tensor parallelism."""
    c = target.config
    windows = [c.window_of(layer) or 0 for layer in range(c.num_layers)]
    if (not config.hybrid_kv or draft is not None or config.tensor_parallel_size > 1
            or not any(0 < w < max_context for w in windows)):
        return None
    return layer_groups(windows)


class Engine:
    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | LoadedHead | None = None,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.config = c = config or EngineConfig()
        if isinstance(target, LoadedHead):
            raise ModelLoadError(f"{target.folder}: an EAGLE-3 head is a draft, not a target")
        # what differs by proposer, decided here once (core/proposer_rules.py)
        rules = (HEAD if isinstance(draft, LoadedHead)
                 else NO_MODEL if draft is None else DRAFT_MODEL)
        if isinstance(draft, LoadedHead):
            check_head_compatible(target, draft)
        elif draft is not None:
            check_draft_compatible(target, draft)
            draft.model.restrict_output_vocab(draft_vocabulary(draft))
        self.tokenizer = tokenizer
        self.max_context = min([c.max_context, target.config.max_position]
                               + ([draft.config.max_position] if draft else []))
        identity = target.identity + (draft.identity if draft else b"no-draft")
        policy = SpecPolicy(c.spec_k if draft is not None else 0, rules, adaptive=c.adaptive_k,
                            model_free_k=c.model_free_k if c.spec_k else 0)
        groups = hybrid_groups(target, draft, c, self.max_context)
        count = 1 if groups is None else len(groups.windows)
        pool = BlockPool(c.num_blocks * count, c.block_size, model_identity=identity)
        corpus = (corpus_table(c.spec_corpus, tokenizer)
                  if "corpus" in c.model_free_methods and policy.model_free_k else None)
        self.core = EngineCore(c, pool if groups is None else GroupedPool(pool, groups),
                               policy, self.max_context, tokenizer,
                               tuple(target.config.eos_token_ids), corpus)
        self.intake = Intake(c, tokenizer, target.config.vocab_size, self.max_context,
                             policy.max_proposals, tuple(target.config.eos_token_ids))
        self.executor = (Executor(target, draft, c, groups=groups)
                         if c.tensor_parallel_size == 1
                         else TensorParallelExecutor(target, draft, c))
        if policy.adaptive and policy.max_proposals > 0:
            self._calibrate()

    def _calibrate(self) -> None:
        """Time both models' forwards (the target's alone without a draft)
        for the adaptive-k policy."""
        costs = self.executor.measure_costs(self.config, self.max_context)
        # a draft left unmeasured (a busy machine spent the budget) keeps the
        # priors for both, which price it relative to the target's step
        drafts = self.core.policy.k_max > 0
        if len(costs.target) < 2 or (drafts and len(costs.draft) < 2):
            log.warning("speculation costs: too few forwards timed; keeping the priors")
            return
        self.core.policy.calibrate(fit_segments(costs.target),
                                   fit_segments(costs.draft) if costs.draft else [])

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
        constraint: Constraint | None = None,
    ) -> Request:
        request = self.make_request(request_id, prompt, params, priority, deadline,
                                    constraint=constraint)
        self.submit(request)
        return request

    def make_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
        *,
        prompt_field: str = "prompt",
        arrival: float | None = None,
        constraint: Constraint | None = None,
    ) -> Request:
        """Validate, tokenize and compile the constraint (core/intake.py);
        touches no engine state, so any thread may call it."""
        return self.intake.make_request(request_id, prompt, params, priority, deadline,
                                        prompt_field=prompt_field, arrival=arrival,
                                        constraint=constraint)

    def submit(self, request: Request) -> None:
        self.core.submit(request)

    def abort(self, request_id: str) -> bool:
        """Takes effect at the next step boundary. False if unknown or finished."""
        return self.core.abort(request_id)

    def fail_all(self) -> list[RequestOutput]:
        """End every request with an error and free its blocks (after a fault)."""
        return self.core.fail_all()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        batch = self.core.schedule()
        return self.core.apply(self.executor.execute(batch, self.core.guides()))

    def stats(self) -> EngineStats:
        return self.core.stats()

    def on_fault(self, handler: Callable[[str], None]) -> None:
        """Call handler(reason), from another thread, if the executor fails
        beyond recovery (a tensor-parallel rank died): stop serving."""
        self.executor.on_fault(handler)

    def close(self) -> None:
        """Stop what the executor started (tensor-parallel ranks)."""
        self.executor.close()

    # ------------------------------------------------------------------ read-only views

    @property
    def k_max(self) -> int:
        """Proposals per step at most, by any method (0: none)."""
        return self.core.policy.max_proposals

    @property
    def requests(self) -> dict[str, Request]:
        return self.core.requests

    @property
    def pool(self) -> Pool:
        return self.core.pool

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def policy(self) -> SpecPolicy:
        return self.core.policy
