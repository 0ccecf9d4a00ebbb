"""Continuous batching: which sequences run this step, with how many tokens.

Running sequences go first, best (priority, arrival) first: each computes its
uncomputed tokens, chunked to the step's token budget, and speculates k
tokens when the chunk reaches its newest token, as much of that as the
proposer can run (its rules' `trim`, core/proposer_rules.py), so that a
step reserves tentative slots for what it runs and no more (and a prompt's,
when it is admitted, for its later chunks). When the pool runs out, the
worst running sequence is preempted by recompute: its blocks are freed and it
waits again, keeping its tokens, to be re-prefilled (often from the prefix
cache). Waiting sequences are admitted in (priority, arrival) order while the
budget, the sequence cap and the pool allow. Aborted requests and requests
past their deadline are dropped before they spend more compute.

Pure Python; imports no torch.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable
from typing import NamedTuple

from specpage.core import ledger
from specpage.core.block_pool import Copy
from specpage.core.engine_config import EngineConfig
from specpage.core.layer_groups import Pool
from specpage.core.model_free import NO_SPECULATION, Speculation
from specpage.core.proposer_rules import ProposerRules
from specpage.core.request import FinishReason, Sequence, Status

# (sequence, running batch size) -> its proposals this step
Speculate = Callable[[Sequence, int], Speculation]


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new: int  # uncomputed tokens this step computes
    k: int  # proposals (0 unless the chunk reaches the newest token)
    speculation: Speculation = NO_SPECULATION  # who makes the k proposals, and how

    @property
    def wants_logits(self) -> bool:
        return self.num_new == self.seq.num_uncomputed


class StepPlan(NamedTuple):
    scheduled: list[ScheduledSeq]
    copies: list[Copy]  # copy-on-write (src, dst) blocks, to copy in both models
    dropped: list[Sequence]  # aborted or past the deadline, already freed


def _key(seq: Sequence) -> tuple[int, float, int]:
    return (seq.request.priority, seq.request.arrival, seq.seq_id)


def _slots(seq: Sequence) -> int:
    """Running places a sequence will take: a first sample forks into n
    once its prompt is done."""
    return seq.request.params.n if seq.index == 0 and not seq.num_output else 1


class Scheduler:
    def __init__(self, config: EngineConfig, max_context: int, pool: Pool,
                 speculate: Speculate, rules: ProposerRules) -> None:
        self.config = config
        self.max_context = max_context  # positions both models can hold
        self.pool = pool
        self.speculate = speculate
        self.rules = rules  # the draft's: what of a span it can run, its cache salt
        self.waiting: list[tuple[tuple[int, float, int], Sequence]] = []  # heap
        self.running: list[Sequence] = []  # sorted by _key
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_prompt_tokens = 0  # tokens allocated as prompts (recomputes included)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        heapq.heappush(self.waiting, (_key(seq), seq))

    def add_running(self, seq: Sequence) -> None:
        """A sequence already in the pool (a fork) joins the running batch."""
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=_key)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence and free its blocks, whatever queue it is in."""
        if seq.finished:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            ledger.release(self.pool, seq)
        else:
            self.waiting = [(k, s) for k, s in self.waiting if s is not seq]
            heapq.heapify(self.waiting)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def schedule(self, now: float) -> StepPlan:
        dropped = self._drop_ended(now)
        budget = self.config.max_step_tokens
        scheduled: list[ScheduledSeq] = []
        copies: list[Copy] = []
        preempted: list[Sequence] = []
        batch = len(self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new, spec = self._span(seq, budget, batch)
            if num_new == 0:
                break  # k never shrinks to fit: the rest wait for the next step
            k = self._fit(seq, num_new, spec.k, preempted)
            if k < 0:  # the sequence preempted itself
                continue
            copies += self._reserve(seq, num_new + k)
            scheduled.append(ScheduledSeq(seq, num_new, k, spec))
            budget -= num_new + k
            i += 1
        if not preempted:
            self._admit(scheduled, budget, batch, now)
        return StepPlan(scheduled, copies, dropped)

    # ------------------------------------------------------------------ helpers

    def _span(self, seq: Sequence, budget: int, batch: int) -> tuple[int, Speculation]:
        """Tokens to compute and proposals to make this step, within budget,
        as much of them as the proposer can run. A span that would reach the
        newest token but not fit its proposals stops one token short
        instead, so the next step needs only 1 + k."""
        num_new = min(seq.num_uncomputed, budget)
        spec = self._speculation(seq, num_new, batch)
        if num_new + spec.k <= budget:
            return self.rules.trim(seq, num_new, spec)
        return min(seq.num_uncomputed - 1, budget), NO_SPECULATION

    def _speculation(self, seq: Sequence, num_new: int, batch: int) -> Speculation:
        if num_new < seq.num_uncomputed:
            return NO_SPECULATION
        params = seq.request.params
        if not seq.num_output:
            # The first token is sampled plainly, so samples that fork from
            # this step's logits draw it exactly as a request of their own would.
            return NO_SPECULATION
        room = min(
            params.max_tokens - seq.num_output - 1,  # k + 1 tokens at most this step
            self.max_context - seq.num_tokens,
        )
        return self.speculate(seq, batch).cut(max(0, room))

    def _fit(self, seq: Sequence, num_new: int, k: int, preempted: list[Sequence]) -> int:
        """Make room for seq's reservation by preempting the worst running
        sequences. k itself never shrinks under pressure: a seeded sample
        depends on k, and must not depend on what else runs. Returns k, or
        -1 if seq itself was preempted."""
        while not self._fits(seq, num_new + k):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return -1
        return k

    def _fits(self, seq: Sequence, total: int) -> bool:
        need = total - self.pool.num_tentative(seq.seq_id)
        return need <= 0 or self.pool.blocks_needed(seq.seq_id, need) <= (
            self.pool.num_available_blocks
        )

    def _reserve(self, seq: Sequence, total: int) -> list[Copy]:
        need = total - self.pool.num_tentative(seq.seq_id)
        return self.pool.reserve(seq.seq_id, need) if need > 0 else []

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        ledger.release(self.pool, seq)
        self.num_preemptions += 1
        self.add(seq)

    def _admit(
        self, scheduled: list[ScheduledSeq], budget: int, batch: int, now: float
    ) -> None:
        pool = self.pool
        keep_free = int(self.config.admission_watermark * pool.num_blocks)
        occupied = sum(map(_slots, self.running))
        while self.waiting and budget > 0:
            seq = self.waiting[0][1]
            if occupied + _slots(seq) > self.config.max_num_seqs:
                break
            occupied += _slots(seq)
            # The watermark keeps room for running sequences to grow; with
            # none running, any request that passed validation may start.
            reserve = keep_free if self.running else 0
            if pool.prompt_blocks(seq.num_tokens) > pool.num_available_blocks - reserve:
                break
            cached = ledger.admit(pool, seq, self.rules)
            num_new, spec = self._span(seq, budget, batch)
            k = spec.k
            if num_new == 0 or not self._fits(seq, num_new + k):
                ledger.release(pool, seq)  # wait until the proposals fit too
                break
            heapq.heappop(self.waiting)
            self.num_cached_tokens += cached
            self.num_prompt_tokens += seq.num_tokens
            if seq.request.timings.first_scheduled is None:
                seq.request.timings.first_scheduled = now
                seq.request.usage.cached_tokens += cached
            self.add_running(seq)
            self._reserve(seq, num_new + k)  # a fresh prompt shares no partial block
            scheduled.append(ScheduledSeq(seq, num_new, k, spec))
            budget -= num_new + k

    def _drop_ended(self, now: float) -> list[Sequence]:
        dropped = []
        for seq in [*self.running, *(s for _, s in self.waiting)]:
            request = seq.request
            if request.aborted:
                self.finish(seq, FinishReason.ABORT)
            elif request.deadline is not None and now >= request.deadline:
                self.finish(seq, FinishReason.TIMEOUT)
            else:
                continue
            dropped.append(seq)
        return dropped
