"""The engine: requests in, token deltas out, one step at a time.

A step is the pipeline of docs/DESIGN.md: schedule (admit, preempt, reserve
tentative slots), copy blocks written on share, let the draft propose,
let the target verify, commit and roll back in the pool, and emit.
Synchronous and single-threaded; the daemon runs it off its event loop.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import msgspec

from specpage.block_pool import BlockPool
from specpage.detokenizer import IncrementalDetokenizer
from specpage.engine_config import EngineConfig
from specpage.model_runner import ModelRunner
from specpage.models.loader import LoadedModel, check_draft_compatible, draft_vocabulary
from specpage.request import (
    FinishReason,
    Request,
    SamplingParams,
    Sequence,
    Timings,
    Usage,
    ValidationError,
    validate_prompt,
)
from specpage.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, StepPlan
from specpage.spec import cost_cache
from specpage.spec.calibrate import Plan, calibration_sizes, fit_segments, measure
from specpage.spec.policy import SpecPolicy
from specpage.spec.proposer import DraftProposer, Proposal
from specpage.spec.verifier import Verdict, Verifier

log = logging.getLogger("specpage.engine")


class RequestOutput(msgspec.Struct):
    """What one step produced for one sample of a request."""

    request_id: str
    index: int  # sample, 0..n-1
    token_ids: list[int]  # new this step
    text: str  # new text this step
    num_tokens: int  # completion tokens of this sample so far
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    usage: Usage | None = None  # on the last output of the request
    timings: Timings | None = None


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


class Engine:
    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        c = self.config
        if draft is not None:
            check_draft_compatible(target, draft)
            draft.model.restrict_output_vocab(draft_vocabulary(draft))
        self.target = target
        self.tokenizer = tokenizer
        identity = target.identity + (draft.identity if draft else b"no-draft")
        self.pool = BlockPool(c.num_blocks, c.block_size, model_identity=identity)
        max_context = min([c.max_context, target.config.max_position]
                          + ([draft.config.max_position] if draft else []))
        spec_k = c.spec_k if draft is not None else 0
        self.policy = SpecPolicy(spec_k, adaptive=c.adaptive_k)
        self.scheduler = Scheduler(
            SchedulerConfig(c.max_num_seqs, c.max_step_tokens, c.admission_watermark,
                            max_context),
            self.pool,
            self.policy.choose_k,
        )
        target_runner = ModelRunner(target, c.num_blocks, c.block_size)
        self.runners = [target_runner]
        self.verifier = Verifier(target_runner, self.pool)
        self.proposer: DraftProposer | None = None
        if draft is not None:
            draft_runner = ModelRunner(draft, c.num_blocks, c.block_size)
            self.runners.append(draft_runner)
            self.proposer = DraftProposer(draft_runner, self.pool)
        self.max_context = max_context
        if draft is not None and self.policy.adaptive and spec_k > 0:
            self._calibrate(target_runner, draft_runner, (target.identity, draft.identity))
        self.requests: dict[str, Request] = {}
        self.num_aborts = 0  # requests a caller aborted before they finished
        self._seq_ids = itertools.count()

    def _calibrate(self, target: ModelRunner, draft: ModelRunner,
                   identities: tuple[bytes, bytes]) -> None:
        """Time both models' forwards for the adaptive-k policy
        (spec/calibrate.py), or read what an earlier start measured on this
        machine (spec/cost_cache.py)."""
        c, start = self.config, time.perf_counter()
        sizes = calibration_sizes(min(c.max_step_tokens, c.max_num_seqs * (c.spec_k + 1)))
        plan = Plan.make(sizes, c.max_num_seqs, c.num_blocks, self.max_context)
        path = cost_cache.cache_path(identities, plan, target.dtype, c.block_size)
        costs, source = cost_cache.load(path), "read from " + str(path)
        if costs is None:
            source = "measured"
            measured = measure([(target, True), (draft, False)], plan)
            costs = cost_cache.CachedCosts(*(m.points() for m in measured))
            if all(len(m) == len(sizes) for m in measured):
                cost_cache.store(path, costs)
        if min(len(costs.target), len(costs.draft)) < 2:  # no slope: keep the priors
            log.warning("speculation costs: too few forwards timed in %.1f s",
                        time.perf_counter() - start)
            return
        self.policy.calibrate(fit_segments(costs.target), fit_segments(costs.draft))
        log.info("speculation costs %s (%d and %d sizes) in %.1f s", source,
                 len(costs.target), len(costs.draft), time.perf_counter() - start)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
    ) -> Request:
        request = self.make_request(request_id, prompt, params, priority, deadline)
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
    ) -> Request:
        """Validate and tokenize; touches no engine state, so any thread may call it.

        prompt_field names the prompt in errors (a front end's own field);
        arrival (time.monotonic()) is when the caller received the request,
        now if None, so queue and end-to-end times include tokenizing."""
        params.validate(self.config.stop_limits)
        if params.n > self.config.max_num_seqs:
            raise ValidationError("n", f"{params.n} samples exceed max_num_seqs "
                                  f"({self.config.max_num_seqs})")
        vocab_size = self.target.config.vocab_size
        unknown = next((t for t in params.stop_token_ids if t >= vocab_size), None)
        if unknown is not None:  # it could never be sampled
            raise ValidationError("stop_token_ids",
                                  f"token id {unknown} outside 0..{vocab_size - 1}")
        prompt_ids = self._tokenize(prompt, prompt_field)
        validate_prompt(prompt_ids, vocab_size, self.max_context, prompt_field)
        self._check_fits(len(prompt_ids), params)
        if params.stop and self.tokenizer is None:
            raise ValidationError("stop", "stop strings need a tokenizer")
        return Request(request_id, tuple(prompt_ids), params, priority, deadline,
                       arrival=time.monotonic() if arrival is None else arrival)

    def submit(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValidationError("request_id", f"{request.request_id!r} is already running")
        seq = self._new_sequence(request, 0, list(request.prompt_token_ids))
        self.requests[request.request_id] = request
        self.scheduler.add(seq)

    def fail_all(self) -> list[RequestOutput]:
        """End every request with an error and free its blocks (after a fault)."""
        outputs = []
        for request in list(self.requests.values()):
            outputs += self._unforked(request, FinishReason.ERROR)
            for seq in request.sequences:
                if not seq.finished:
                    outputs.append(self._finish(seq, FinishReason.ERROR, [], ""))
            if request.request_id in self.requests:
                # its other samples had ended without their final output
                # reaching anyone; end the request itself
                del self.requests[request.request_id]
                outputs.append(RequestOutput(
                    request.request_id, 0, [], "", 0, finished=True,
                    finish_reason=str(FinishReason.ERROR), usage=request.usage,
                    timings=request.timings))
        self.pool.check_integrity()
        return outputs

    def abort(self, request_id: str) -> bool:
        """Takes effect at the next step boundary. False if unknown or finished."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        if not request.aborted:
            self.num_aborts += 1
        request.aborted = True
        return True

    @property
    def k_max(self) -> int:
        """Proposals per step at most (0 without a draft)."""
        return self.policy.k_max

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule(time.monotonic())
        self._copy_blocks(plan)
        proposal = self._propose(plan.scheduled)
        verdicts = self.verifier.verify(plan.scheduled, proposal)
        self._observe(plan)
        self._commit(plan.scheduled, verdicts)
        return self._emit(plan, verdicts)

    def _observe(self, plan: StepPlan) -> None:
        """Feed the step's k and forward costs to the speculation policy."""
        self.policy.observe_step([e.k for e in plan.scheduled if e.wants_logits])
        self.policy.observe_costs(self.verifier.last_cost,
                                  self.proposer.last_costs if self.proposer else [])

    def _copy_blocks(self, plan: StepPlan) -> None:
        for runner in self.runners:
            runner.copy_blocks(plan.copies)

    def _propose(self, scheduled: list[ScheduledSeq]) -> Proposal:
        if self.proposer is None or not scheduled:
            return Proposal([[] for _ in scheduled], [None for _ in scheduled])
        return self.proposer.propose(scheduled)

    def _commit(self, scheduled: list[ScheduledSeq], verdicts: list[Verdict]) -> None:
        for entry, verdict in zip(scheduled, verdicts, strict=True):
            seq = entry.seq
            start = seq.num_computed
            computed = (seq.token_ids[start : start + entry.num_new] + verdict.new_tokens)
            self.pool.commit(seq.seq_id, computed[: verdict.num_commit])
            if entry.wants_logits:
                self.pool.rollback(seq.seq_id)
            seq.num_computed += verdict.num_commit
            if entry.k > 0:  # the draft ran over it: caught up, and its accepted proposals
                seq.num_draft_computed = seq.num_computed

    def _emit(self, plan: StepPlan, verdicts: list[Verdict]) -> list[RequestOutput]:
        outputs = []
        for seq in plan.dropped:
            reason = seq.finish_reason or FinishReason.ABORT
            outputs += self._unforked(seq.request, reason)
            outputs.append(self._finish(seq, reason, [], ""))
        for entry, verdict in zip(plan.scheduled, verdicts, strict=True):
            seq = entry.seq
            request = seq.request
            self.policy.observe_acceptance(seq, verdict.num_proposed, verdict.num_accepted)
            request.usage.drafted_tokens += verdict.num_proposed
            request.usage.accepted_tokens += verdict.num_accepted
            if verdict.fork_tokens:
                outputs += self._fork(seq, verdict.fork_tokens, verdict.fork_logprobs)
            if verdict.new_tokens:
                outputs.append(self._append(seq, verdict.new_tokens, verdict.logprobs))
        return outputs

    # ------------------------------------------------------------------ emitting

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> RequestOutput:
        """Add sampled tokens to a sequence, cut at its first stop condition."""
        params = seq.request.params
        kept, reason = [], None
        eos = () if params.ignore_eos else self.target.config.eos_token_ids
        for token in tokens:
            kept.append(token)
            if token in eos or token in params.stop_token_ids:
                reason = FinishReason.STOP
            elif (len(seq.output_token_ids) + len(kept) >= params.max_tokens
                  or seq.num_tokens + len(kept) >= self.max_context):
                reason = FinishReason.LENGTH
            if reason:
                break
        text = ""
        detok: IncrementalDetokenizer | None = seq.detok  # type: ignore[assignment]
        if detok is not None:
            text_ids = kept[:-1] if reason is FinishReason.STOP else kept
            text = detok.add(text_ids)
            if detok.stopped:
                # A stop string ends the output at the token that completes it,
                # even when more tokens were accepted in the same step (and
                # before a length limit reached with that same token).
                del kept[detok.used :]
                reason = FinishReason.STOP
        seq.token_ids.extend(kept)
        seq.logprobs.extend(logprobs[: len(kept)])
        request = seq.request
        if request.timings.first_token is None:
            request.timings.first_token = time.monotonic()
        if reason:
            return self._finish(seq, reason, kept, text, logprobs[: len(kept)])
        return RequestOutput(request.request_id, seq.index, kept, text,
                             len(seq.output_token_ids),
                             logprobs=logprobs[: len(kept)] if params.logprobs else None)

    def _finish(
        self, seq: Sequence, reason: FinishReason, tokens: list[int], text: str,
        logprobs: list[float] | None = None,
    ) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        detok: IncrementalDetokenizer | None = seq.detok  # type: ignore[assignment]
        if detok is not None and not detok.stopped:
            text += detok.flush()  # held back for a stop string that never came
        request = seq.request
        request.usage.completion_tokens = sum(len(s.output_token_ids) for s in request.sequences)
        output = RequestOutput(
            request.request_id, seq.index, tokens, text, len(seq.output_token_ids),
            finished=True, finish_reason=str(reason),
            logprobs=logprobs if request.params.logprobs else None,
        )
        request.num_ended += 1
        if request.num_ended == len(request.sequences):  # the request's last output
            request.timings.finished = time.monotonic()
            output.usage, output.timings = request.usage, request.timings
            del self.requests[request.request_id]
        return output

    @staticmethod
    def _unforked(request: Request, reason: FinishReason) -> list[RequestOutput]:
        """Samples 1..n-1 fork at sample 0's first token; a request that ends
        before it (aborted, past its deadline, failed) ends them too, each
        with an output of its own, before the request's last output."""
        return [RequestOutput(request.request_id, index, [], "", 0, finished=True,
                              finish_reason=str(reason))
                for index in range(len(request.sequences), request.params.n)]

    def _fork(
        self, parent: Sequence, first_tokens: list[int], logprobs: list[float]
    ) -> list[RequestOutput]:
        """Samples 1..n-1 share the parent's committed blocks from here on."""
        outputs = []
        for index, token in enumerate(first_tokens, start=1):
            child = self._new_sequence(parent.request, index, list(parent.token_ids))
            self.pool.fork(parent.seq_id, child.seq_id)
            child.num_computed = parent.num_computed
            child.num_draft_computed = parent.num_draft_computed
            self.scheduler.add_running(child)
            outputs.append(self._append(child, [token], logprobs[index - 1 : index]))
        return outputs

    # ------------------------------------------------------------------ helpers

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), request, index, token_ids)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params.stop
            )
        request.sequences.append(seq)
        return seq

    def _tokenize(self, prompt: str | Seq[int], prompt_field: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValidationError(prompt_field,
                                      "text prompts need a tokenizer; send token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        positions = prompt_len + params.max_tokens + self.policy.k_max + 1
        blocks = -(-positions // self.config.block_size) * params.n
        if blocks > self.config.num_blocks:
            raise ValidationError(
                "max_tokens",
                f"prompt ({prompt_len}) + max_tokens ({params.max_tokens}) need {blocks} KV "
                f"blocks; the pool has {self.config.num_blocks}",
            )

    def stats(self) -> EngineStats:
        pool = self.pool.stats()
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=self.scheduler.num_waiting,
            free_blocks=pool.free,
            cached_blocks=pool.cached,
            in_use_blocks=pool.in_use,
            tentative_blocks=pool.tentative,
            drafted_tokens=self.policy.num_drafted,
            accepted_tokens=self.policy.num_accepted,
            acceptance=self.policy.num_accepted / max(1, self.policy.num_drafted),
            per_token_acceptance=self.policy.num_accepted / max(1, self.policy.num_tested),
            current_k=self.policy.last_k,
            preemptions=self.scheduler.num_preemptions,
            prefix_cached_tokens=self.scheduler.num_cached_tokens,
            prompt_tokens=self.scheduler.num_prompt_tokens,
            total_blocks=pool.total,
            accepted_by_position=tuple(self.policy.accepted_by_position),
            aborts=self.num_aborts,
        )
