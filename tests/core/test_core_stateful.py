"""The core through its value boundary, without torch or a model.

A fake executor answers each `StepBatch` with a scripted `StepResult`, and
simulates both models' KV: each slot holds the token id a model wrote there
(the target writes its span and the proposals it verifies; the draft its
catch-up span and every proposal but the last, which it never reads back).
After every step, every running sequence's committed positions must hold
its own tokens in the target's KV, and the draft's KV must hold them up to
where the core says the draft has caught up: so copy-on-write, the prefix
cache, forks, preemption and the draft-lag rule all show in the KV, not
only in the counters. The pool's invariants and the ledger's counter
equality are checked every step too.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specpage.core import ledger
from specpage.core.block_pool import BlockPool
from specpage.core.engine_config import EngineConfig
from specpage.core.engine_core import EngineCore, StepResultError
from specpage.core.model_free import Speculation
from specpage.core.policy import SpecPolicy
from specpage.core.proposer_rules import DRAFT_MODEL
from specpage.core.request import Request, SamplingParams
from specpage.core.step import SeqResult, StepBatch, StepResult

BLOCK_SIZE = 4
NUM_BLOCKS = 16  # small enough that a few requests preempt each other
K_MAX = 3
EOS = 0
VOCAB = 50
PREFIXES = ([5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 20, 21], [30] * 10)


class FakeExecutor:
    """Scripted results; both models' KV simulated slot by slot."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.target: dict[int, int] = {}  # slot -> token id
        self.draft: dict[int, int] = {}

    def execute(self, batch: StepBatch) -> StepResult:
        for src, dst in batch.copies:
            for kv in (self.target, self.draft):
                for offset in range(BLOCK_SIZE):
                    src_slot, dst_slot = src * BLOCK_SIZE + offset, dst * BLOCK_SIZE + offset
                    if src_slot in kv:
                        kv[dst_slot] = kv[src_slot]
                    else:
                        kv.pop(dst_slot, None)
        results = []
        for w in batch.seqs:
            proposals = [self.rng.randrange(1, VOCAB) for _ in range(w.k)]
            if w.k:  # the draft catches up, then reads back all but its last proposal
                self._write(self.draft, w.block_table, w.draft_start,
                            w.draft_tokens + w.tokens + proposals[:-1])
            self._write(self.target, w.block_table, w.start, w.tokens + proposals)
            if not w.sample:
                results.append(SeqResult())
                continue
            accepted = self.rng.randint(0, w.k)
            tokens = proposals[:accepted] + [self.rng.randrange(0, VOCAB)]
            forks = [self.rng.randrange(1, VOCAB) for _ in range(w.num_forks)]
            results.append(SeqResult(tokens, w.k, accepted, [], forks, []))
        return StepResult(results, (len(batch.seqs), 0.01), [])

    @staticmethod
    def _write(kv: dict[int, int], table: list[int], start: int, tokens: list[int]) -> None:
        for position, token in enumerate(tokens, start):
            kv[table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE] = token


class CoreMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1))
    def setup(self, seed: int) -> None:
        self.rng = random.Random(seed)
        config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_seqs=4,
                              max_step_tokens=12, max_context=48, spec_k=K_MAX)
        pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, model_identity=b"fake")
        self.core = EngineCore(config, pool, SpecPolicy(K_MAX, DRAFT_MODEL, adaptive=False), 48,
                               eos_token_ids=(EOS,))
        self.core.scheduler.speculate = lambda seq, batch: Speculation(self.rng.randint(0, K_MAX))
        self.executor = FakeExecutor(self.rng)
        self.ids = 0
        self.ended: dict[str, set[int]] = {}  # request -> samples whose last output came
        self.finals: set[str] = set()  # requests whose last output (with usage) came
        self.samples: dict[str, int] = {}
        self.reasons: list[str | None] = []  # every sample's finish reason

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, VOCAB - 1),
                                                          max_size=6),
          n=st.integers(1, 3), max_tokens=st.integers(1, 24), greedy=st.booleans(),
          priority=st.integers(0, 1))
    def submit(self, prefix: list[int], tail: list[int], n: int, max_tokens: int,
               greedy: bool, priority: int) -> None:
        request_id = f"r{self.ids}"
        self.ids += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0 if greedy else 1, n=n)
        self.core.submit(Request(request_id, tuple(prefix + tail), params, priority))
        self.ended[request_id] = set()
        self.samples[request_id] = n

    @rule(count=st.integers(2, 5), max_tokens=st.integers(8, 30))
    def burst(self, count: int, max_tokens: int) -> None:
        """Long requests at once: the pool runs short and preempts."""
        for i in range(count):
            self.submit(PREFIXES[i % len(PREFIXES)], [i + 1], 1 + i % 2, max_tokens, i % 3 == 0,
                        0)

    @precondition(lambda self: bool(self.core.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.core.abort(data.draw(st.sampled_from(sorted(self.core.requests))))

    @precondition(lambda self: bool(self.core.requests))
    @rule(data=st.data())
    def deadline_passes(self, data: st.DataObject) -> None:
        request = self.core.requests[data.draw(st.sampled_from(sorted(self.core.requests)))]
        request.deadline = 0.0  # before any step's clock

    @rule(steps=st.integers(1, 6))
    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def step(self) -> None:
        if not self.core.has_unfinished():
            return
        batch = self.core.schedule()
        self.reserved_as_run(batch)
        outputs = self.core.apply(self.executor.execute(batch))
        for out in outputs:
            assert out.request_id not in self.finals, out  # nothing after the last output
            if out.finished:
                self.reasons.append(out.finish_reason)
                assert out.index not in self.ended[out.request_id], out
                self.ended[out.request_id].add(out.index)
            if out.usage is not None:
                assert self.ended[out.request_id] == set(range(self.samples[out.request_id]))
                self.finals.add(out.request_id)

    def reserved_as_run(self, batch: StepBatch) -> None:
        """Each scheduled sequence's tentative slots are what its step runs:
        exactly its tokens and proposals where it samples; else its tokens,
        and at most the prompt positions it has yet to compute."""
        running = {seq.seq_id: seq for seq in self.core.scheduler.running}
        for w in batch.seqs:
            tentative = self.core.pool.num_tentative(w.seq_id)
            if w.sample:
                assert tentative == len(w.tokens) + w.k, (w, tentative)
            else:
                assert w.k == 0 and len(w.tokens) <= tentative, (w, tentative)
                assert tentative <= running[w.seq_id].num_uncomputed, (w, tentative)

    @invariant()
    def pool_and_counters_agree(self) -> None:
        if not hasattr(self, "core"):
            return
        pool = self.core.pool
        pool.check_integrity()
        for seq in self.core.scheduler.running:
            ledger.check_tokens(pool, seq)
            table = pool.block_table(seq.seq_id)
            for position in range(seq.num_computed):
                slot = table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
                assert self.executor.target.get(slot) == seq.token_ids[position], (seq, position)
                if position < seq.num_draft_computed:
                    assert self.executor.draft.get(slot) == seq.token_ids[position], (
                        seq, position)
        for _, seq in self.core.scheduler.waiting:
            assert seq.seq_id not in pool and seq.num_computed == 0
        for seq in self.core.scheduler.running:
            # between steps a sequence's only tentative slots are the prompt
            # positions it has yet to compute; proposals were rolled back
            assert pool.num_tentative(seq.seq_id) in (0, seq.num_uncomputed), seq
        # a request is known to the core exactly until its last output
        assert set(self.core.requests) == set(self.ended) - self.finals

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for request_id in list(self.core.requests):
            self.core.abort(request_id)
        for _ in range(100):
            if not self.core.has_unfinished():
                break
            self.step()
        assert not self.core.requests and self.finals == set(self.ended)
        assert self.core.pool.stats().in_use == 0  # every block free or cached


CoreMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_core_through_the_boundary = CoreMachine.TestCase


def test_long_random_runs_reach_every_path() -> None:
    """Long runs of the same machine, driven by a seeded generator rather
    than Hypothesis, so every path is known to be reached: preemption,
    forks, prefix-cache hits, accepted and rejected proposals, aborts and
    deadlines, all with the checks after every step."""
    totals = {"preemptions": 0, "cached": 0, "accepted": 0, "rejected": 0, "forks": 0,
              "aborts": 0, "timeouts": 0}
    for seed in range(12):
        rng = random.Random(seed)
        machine = CoreMachine()
        machine.setup(seed=seed)
        for _ in range(150):
            action = rng.random()
            if action < 0.15:
                machine.burst(rng.randint(2, 5), rng.randint(8, 30))
            elif action < 0.3:
                machine.submit(rng.choice(PREFIXES), [rng.randrange(1, VOCAB)], rng.randint(1, 3),
                               rng.randint(1, 24), rng.random() < 0.5, rng.randint(0, 1))
            elif action < 0.35 and machine.core.requests:
                machine.core.abort(rng.choice(sorted(machine.core.requests)))
            elif action < 0.38 and machine.core.requests:
                machine.core.requests[rng.choice(sorted(machine.core.requests))].deadline = 0.0
            else:
                machine.step()
            machine.pool_and_counters_agree()
        stats = machine.core.stats()
        totals["preemptions"] += stats.preemptions
        totals["cached"] += stats.prefix_cached_tokens
        totals["accepted"] += stats.accepted_tokens
        totals["rejected"] += stats.drafted_tokens - stats.accepted_tokens
        totals["forks"] += sum(n > 1 for n in machine.samples.values())
        totals["aborts"] += stats.aborts
        machine.teardown()
        totals["timeouts"] += sum(1 for r in machine.reasons if r == "timeout")
    assert all(totals.values()), totals


def test_the_core_imports_no_torch() -> None:
    """The core runs without torch: its modules import none."""
    code = ("import sys; import specpage.core.engine_core, specpage.core.intake; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_a_result_that_does_not_fit_its_batch_is_refused() -> None:
    core = EngineCore(EngineConfig(block_size=4, num_blocks=16, spec_k=2), BlockPool(16, 4),
                      SpecPolicy(2, DRAFT_MODEL, adaptive=False), 48, eos_token_ids=(EOS,))
    core.submit(Request("a", (5, 6, 7), SamplingParams(max_tokens=4)))
    batch = core.schedule()
    assert [w.sample for w in batch.seqs] == [True]
    with pytest.raises(StepResultError, match="does not fit"):
        core.apply(StepResult([SeqResult([1, 2], 0, 1)]))  # accepted 1 of 0 proposals
    assert core.pool.stats().tentative == 1  # nothing committed or rolled back
    outputs = core.fail_all()
    assert [(o.finish_reason, o.usage is not None) for o in outputs] == [("error", True)]
    assert core.pool.stats().in_use == 0 and not core.requests
    with pytest.raises(StepResultError, match="1 results for 0"):
        core.schedule()  # nothing left to run
        core.apply(StepResult([SeqResult()]))


def test_a_new_sequence_is_priced_at_the_batch_it_joins_waiting_ones_included() -> None:
    """A burst of requests submitted before any step runs is one batch: each
    new sequence asks the policy about every sequence running or waiting and
    itself, up to max_num_seqs."""
    core = EngineCore(EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, spec_k=2),
                      BlockPool(64, 4), SpecPolicy(2, DRAFT_MODEL), 48, eos_token_ids=(EOS,))
    asked: list[int] = []
    core.policy.admits_draft = lambda request, batch: asked.append(batch) or True
    for i in range(6):
        core.submit(Request(f"r{i}", (5, 6, 7), SamplingParams(max_tokens=4)))
    assert asked == [1, 2, 3, 4, 4, 4]
    core.schedule()
    assert len(core.scheduler.running) == 4
    core.submit(Request("late", (5, 6, 7), SamplingParams(max_tokens=4)))
    assert asked[-1] == 4
