"""The core of the engine: its requests, scheduler, pool and speculation
policy, on one side of the step's value boundary.

`schedule` turns the scheduler's plan into a `StepBatch`; `apply` takes the
executor's `StepResult` for it and is the one place a step's outcome
enters the core: it feeds the policy, commits and rolls back through the
ledger, and processes the outputs. Pure Python; no torch.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from specpage.core import ledger
from specpage.core.corpus import CorpusTable
from specpage.core.engine_config import EngineConfig
from specpage.core.grammar import SequenceGrammar
from specpage.core.layer_groups import GroupedPool, Pool
from specpage.core.model_free import (
    NO_SPECULATION,
    Candidate,
    Method,
    ModelFreeProposer,
    Speculation,
)
from specpage.core.outputs import OutputProcessor, RequestOutput
from specpage.core.policy import SpecPolicy
from specpage.core.proposer_rules import ProposerRules
from specpage.core.request import (
    FinishReason,
    Request,
    Sequence,
    TokenLogprobs,
    Usage,
    ValidationError,
)
from specpage.core.scheduler import ScheduledSeq, Scheduler, StepPlan
from specpage.core.step import NOTHING, SeqResult, SeqWork, StepBatch, StepResult, sampling_of


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    free_blocks: int
    cached_blocks: int
    in_use_blocks: int
    tentative_blocks: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance: float  # accepted / drafted
    per_token_acceptance: float  # accepted / tested: the a in (1 - a^(k+1)) / (1 - a)
    current_k: float
    preemptions: int
    prefix_cached_tokens: int
    prompt_tokens: int  # admitted, cumulative
    total_blocks: int
    accepted_by_position: tuple[int, ...]  # cumulative acceptances at proposal 1..k
    aborts: int = 0  # requests aborted by a caller before they finished, cumulative
    # new sequences a draft head was left off (it did not pay), cumulative
    sequences_without_draft: int = 0
    # per proposal method (core/model_free.py's Method) that drafted anything
    by_method: dict[str, MethodStats] = field(default_factory=dict)
    suffix_cache_tokens: int = 0  # earlier requests' tokens the suffix cache holds


class MethodStats(NamedTuple):
    drafted: int
    accepted: int
    accepted_by_position: tuple[int, ...]  # cumulative acceptances at proposal 1..


class StepResultError(ValueError):
    """An executor's result does not fit the batch it was given."""


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        pool: Pool,
        policy: SpecPolicy,
        max_context: int,
        tokenizer: Any = None,
        eos_token_ids: tuple[int, ...] = (),
        corpus: CorpusTable | None = None,
    ) -> None:
        """corpus: the table of the `corpus` proposer (none: it is off)."""
        self.config = config
        self.pool = pool
        self.policy = policy
        # the draft's rules, those the policy was made for (core/proposer_rules.py)
        self.rules = policy.rules
        self.max_context = max_context
        self.model_free = ModelFreeProposer(config, enabled=policy.model_free_k > 0, corpus=corpus)
        self.scheduler = Scheduler(config, max_context, pool, self._speculate, self.rules)
        self.outputs = OutputProcessor(tokenizer, eos_token_ids, max_context, self._end)
        self.requests: dict[str, Request] = {}
        self.num_aborts = 0  # requests a caller aborted before they finished
        self._seq_ids = itertools.count()
        self._plan: StepPlan | None = None  # scheduled, its result not yet applied
        self._scheduled_at = 0.0  # time.perf_counter() when the step began scheduling

    # ------------------------------------------------------------------ requests

    def submit(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValidationError("request_id", f"{request.request_id!r} is already running")
        seq = self._new_sequence(request, 0, list(request.prompt_token_ids))
        seq.draft_on = self.policy.admits_draft(request, self._joins_batch())
        self.requests[request.request_id] = request
        self.scheduler.add(seq)

    def _joins_batch(self) -> int:
        """The batch a new sequence can expect to run in: every sequence
        running or waiting and itself, up to the most a step runs (a burst
        of requests is one batch, though none of it runs yet)."""
        scheduler = self.scheduler
        return min(len(scheduler.running) + scheduler.num_waiting + 1,
                   scheduler.config.max_num_seqs)

    def _speculate(self, seq: Sequence, batch: int) -> Speculation:
        """The scheduler's question: what seq proposes this step."""
        if seq.grammar is not None:
            return self._constrained(seq, batch)
        return self.policy.speculate(seq, batch, self._model_free_candidate(seq, batch))

    def _model_free_candidate(self, seq: Sequence, batch: int) -> Candidate | None:
        """What the proposers that need no model find for seq, as far as
        the policy says it could pay at this batch."""
        if not self.policy.model_free_k:
            return None
        length, floor, scale = self.policy.model_free_lookup(seq, batch)
        return (self.model_free.propose(seq, length, floor=floor, scale=scale) if length
                else None)

    def _constrained(self, seq: Sequence, batch: int) -> Speculation:
        """A constrained sequence's proposals: the run of tokens its grammar
        forces next, where there is one (no model needed, nearly always
        accepted); else what the policy picks, a model-free proposal cut
        before the first token the grammar forbids or the draft's, which
        drafts under the grammar (the executor asks it through `guides`);
        none once the grammar admits only EOS."""
        grammar = seq.grammar
        assert grammar is not None
        spec_k = seq.request.spec_k
        limit = self.policy.max_proposals if spec_k is None else min(
            spec_k, self.policy.max_proposals)
        forced = grammar.forced(limit)
        if forced:
            return Speculation(len(forced), tuple(forced), Method.GRAMMAR, float(len(forced)))
        if grammar.stopped:
            return NO_SPECULATION
        spec = self.policy.speculate(seq, batch, self._model_free_candidate(seq, batch))
        if spec.method is Method.DRAFT:
            return spec
        return spec.cut(grammar.admitted(spec.tokens))

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        """A sequence ends: out of the scheduler and the pool, and of the
        model-free proposer's per-sequence state."""
        self.scheduler.finish(seq, reason)
        self.model_free.end(seq, reason)

    def abort(self, request_id: str) -> bool:
        """Takes effect at the next step boundary. False if unknown or finished."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        if not request.aborted:
            self.num_aborts += 1
        request.aborted = True
        return True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def fail_all(self) -> list[RequestOutput]:
        """End every request with an error and free its blocks (after a fault)."""
        self._plan = None
        outputs = []
        for request in list(self.requests.values()):
            ended = self.outputs.unforked(request, FinishReason.ERROR)
            for seq in request.sequences:
                if not seq.finished:
                    ended.append(self.outputs.finish(seq, FinishReason.ERROR, [], ""))
            if not any(out.usage is not None for out in ended):
                # its other samples had ended without their final output
                # reaching anyone; end the request itself
                ended.append(RequestOutput(
                    request.request_id, 0, [], "", 0, finished=True,
                    finish_reason=str(FinishReason.ERROR), usage=request.usage,
                    timings=request.timings))
            del self.requests[request.request_id]
            outputs += ended
        self.pool.check_integrity()
        return outputs

    # ------------------------------------------------------------------ the step

    def schedule(self) -> StepBatch:
        """This step's work for the executor; `apply` takes its result."""
        assert self._plan is None, "the last step's result was never applied"
        self._scheduled_at = time.perf_counter()
        plan = self.scheduler.schedule(time.monotonic())
        self._plan = plan
        return StepBatch([self._work(e) for e in plan.scheduled], plan.copies)

    def guides(self) -> dict[int, SequenceGrammar]:
        """The grammar of each constrained sequence the scheduled step's
        draft proposes for, by seq_id: what the executor masks its draft
        with (speculation/proposal.py), in this process beside the batch."""
        assert self._plan is not None, "no step scheduled"
        return {e.seq.seq_id: e.seq.grammar for e in self._plan.scheduled
                if e.seq.grammar is not None and e.k > 0
                and e.speculation.method is Method.DRAFT}

    def apply(self, result: StepResult) -> list[RequestOutput]:
        """Take the executor's result for the batch `schedule` returned."""
        plan, self._plan = self._plan, None
        assert plan is not None, "apply without a scheduled step"
        _check_result(plan.scheduled, result)
        decoding = [e for e in plan.scheduled if e.wants_logits]
        drafting = sum(e.k > 0 and e.speculation.method is Method.DRAFT for e in decoding)
        self.policy.observe_step([e.k for e in decoding], drafting)
        self.policy.observe_step_seconds(drafting > 0, result.target_cost, result.draft_costs,
                                         result.seconds)
        if result.target_cost is not None and decoding:  # it decoded only
            model_free = any(e.speculation.method is not Method.DRAFT for e in decoding)
            self.policy.observe_payoff(len(decoding), model_free,
                                       sum(len(done.tokens) for done in result.seqs),
                                       time.perf_counter() - self._scheduled_at)
        self.policy.observe_costs(result.target_cost, result.draft_costs)
        for entry, done in zip(plan.scheduled, result.seqs, strict=True):
            if done.prompt_logprobs:
                _keep_prompt_logprobs(entry.seq, done.prompt_logprobs)
            # a draft under a grammar may stop short of k (speculation/proposal.py)
            k = done.num_proposed if done.tokens else entry.k
            ledger.apply(self.pool, entry.seq, entry.num_new, k, done,
                         self._rules(entry.speculation))
            self.model_free.index(entry.seq)
        outputs = []
        for seq in plan.dropped:
            reason = seq.finish_reason or FinishReason.ABORT
            outputs += self.outputs.unforked(seq.request, reason)
            outputs.append(self.outputs.finish(seq, reason, [], ""))
        for entry, done in zip(plan.scheduled, result.seqs, strict=True):
            seq = entry.seq
            request = seq.request
            self.policy.observe_acceptance(seq, done.num_proposed, done.num_accepted,
                                           entry.speculation)
            self.model_free.observe(seq, entry.speculation, done.num_accepted)
            _count(request.usage, entry.speculation.method, done.num_proposed, done.num_accepted)
            if done.fork_tokens:
                outputs += self._fork(seq, done)
            if done.tokens:
                outputs.append(self.outputs.append(seq, done.tokens, done.logprobs,
                                                   done.top_logprobs))
        for out in outputs:
            if out.usage is not None:  # the request's last output
                del self.requests[out.request_id]
        return outputs

    def _rules(self, speculation: Speculation) -> ProposerRules:
        """Whose rules a sequence's step follows: the draft's where it
        proposed, else those of a step the core proposed for beside it."""
        if speculation.method is Method.DRAFT:
            return self.rules
        return self.rules.beside_model_free()

    def _work(self, entry: ScheduledSeq) -> SeqWork:
        seq = entry.seq
        start, params = seq.num_computed, seq.request.params
        draft_start, draft_tokens = self._rules(entry.speculation).catch_up(seq, entry.k)
        end = start + entry.num_new
        forks = (params.n - 1 if entry.wants_logits and seq.index == 0
                 and not seq.num_output else 0)
        if isinstance(self.pool, GroupedPool):
            block_table, *group_tables = self.pool.block_tables(seq.seq_id)
        else:
            block_table, group_tables = list(self.pool.block_table(seq.seq_id)), []
        return SeqWork(
            seq_id=seq.seq_id,
            start=start,
            tokens=seq.token_ids[start:end],
            block_table=block_table,
            group_tables=group_tables,
            sample=entry.wants_logits,
            k=entry.k,
            draft_start=draft_start,
            draft_tokens=draft_tokens,
            sampling=sampling_of(seq, self.outputs.eos_token_ids),
            num_forks=forks,
            following=seq.token_ids[end] if end < seq.num_tokens else -1,
            draft_state=seq.draft_state,
            draft_on=seq.draft_on,
            proposal=list(entry.speculation.tokens),
            prompt_logprobs=(params.prompt_logprobs if seq.owes_prompt_logprobs
                             and params.prompt_logprobs is not None else -1),
            allowed=(seq.grammar.masks(list(entry.speculation.tokens))
                     if seq.grammar is not None and entry.wants_logits else b""),
        )

    def _fork(self, parent: Sequence, done: SeqResult) -> list[RequestOutput]:
        """Samples 1..n-1 share the parent's committed blocks from here on."""
        outputs = []
        for index, token in enumerate(done.fork_tokens, start=1):
            child = self._new_sequence(parent.request, index, list(parent.token_ids), parent)
            ledger.fork(self.pool, parent, child)
            self.scheduler.add_running(child)
            outputs.append(self.outputs.append(child, [token],
                                               done.fork_logprobs[index - 1 : index],
                                               done.fork_top_logprobs[index - 1 : index]))
        return outputs

    def _new_sequence(self, request: Request, index: int, token_ids: list[int],
                      parent: Sequence | None = None) -> Sequence:
        """A sample of request; a fork of parent (holding what parent holds) if given."""
        seq = Sequence(next(self._seq_ids), request, index, token_ids)
        seq.detok = self.outputs.detokenizer(request)
        if parent is not None and parent.grammar is not None:
            seq.grammar = parent.grammar.copy()
        elif request.grammar is not None:
            seq.grammar = request.grammar.start()
        request.sequences.append(seq)
        return seq

    # ------------------------------------------------------------------ stats

    def stats(self) -> EngineStats:
        pool, policy = self.pool.stats(), self.policy
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=self.scheduler.num_waiting,
            free_blocks=pool.free,
            cached_blocks=pool.cached,
            in_use_blocks=pool.in_use,
            tentative_blocks=pool.tentative,
            drafted_tokens=policy.num_drafted,
            accepted_tokens=policy.num_accepted,
            acceptance=policy.num_accepted / max(1, policy.num_drafted),
            per_token_acceptance=policy.num_accepted / max(1, policy.num_tested),
            current_k=policy.last_k,
            preemptions=self.scheduler.num_preemptions,
            prefix_cached_tokens=self.scheduler.num_cached_tokens,
            prompt_tokens=self.scheduler.num_prompt_tokens,
            total_blocks=pool.total,
            accepted_by_position=tuple(policy.accepted_by_position),
            aborts=self.num_aborts,
            sequences_without_draft=policy.num_without_draft,
            by_method={str(method): MethodStats(c.drafted, c.accepted,
                                                tuple(c.accepted_by_position))
                       for method, c in policy.by_method.items() if c.drafted},
            suffix_cache_tokens=self.model_free.suffix.num_tokens,
        )


def _keep_prompt_logprobs(seq: Sequence, found: list[TokenLogprobs]) -> None:
    """The prompt's log-probabilities a step found, at the positions after
    its span's first (a prompt computed again after preemption finds them again)."""
    kept = seq.request.prompt_logprobs
    del kept[seq.num_computed + 1 :]
    kept.extend(found)


def _count(usage: Usage, method: Method, drafted: int, accepted: int) -> None:
    """A request's drafted and accepted tokens, in all and by method."""
    if not drafted:
        return
    usage.drafted_tokens += drafted
    usage.accepted_tokens += accepted
    counts = usage.by_method.setdefault(str(method), [0, 0])
    counts[0] += drafted
    counts[1] += accepted


def _check_result(scheduled: list[ScheduledSeq], result: StepResult) -> None:
    """A result that does not fit its batch would corrupt the pool: refuse it whole."""
    if len(result.seqs) != len(scheduled):
        raise StepResultError(f"{len(result.seqs)} results for {len(scheduled)} sequences")
    for i, (entry, done) in enumerate(zip(scheduled, result.seqs, strict=True)):
        if not entry.wants_logits:
            ok = msgspec.structs.replace(done, draft_state=b"", draft_lag=0,
                                         prompt_logprobs=[]) == NOTHING
        else:
            # the draft may stop short of k under a grammar (speculation/proposal.py)
            short = (entry.seq.grammar is not None
                     and entry.speculation.method is Method.DRAFT)
            ok = ((done.num_proposed == entry.k or short and done.num_proposed < entry.k)
                  and 0 <= done.num_accepted <= done.num_proposed
                  and len(done.tokens) == done.num_accepted + 1)
        if not ok:
            raise StepResultError(f"result {i} does not fit sequence {entry.seq}: {done}")
