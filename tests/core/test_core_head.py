"""The core through its value boundary with a draft head (proposer_rules.HEAD):
the machine of tests/core/test_core_stateful.py, whose fake executor now
simulates a head's KV instead of a draft model's.

The fake head catches up on the positions a sequence left unabsorbed
before it proposes, writes tentative KV for its deeper proposals, then
absorbs every position the target computed whose next token is known,
unless the sequence did not speculate, has a state and stays within its
block (then it carries them, as the real head does), and returns its state
(here: the last position it absorbed). After every step each running
sequence's committed positions hold its own tokens in the target's KV and,
up to where it lags, in the head's; it lags only within the block being
filled; its state names the position before the first it has not
absorbed, and a head proposes only from a state, in a step that computes
the newest token alone.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from specpage.core.block_pool import BlockPool
from specpage.core.engine_config import EngineConfig
from specpage.core.engine_core import EngineCore
from specpage.core.model_free import Speculation
from specpage.core.policy import SpecPolicy
from specpage.core.proposer_rules import HEAD
from specpage.core.step import SeqResult, StepBatch, StepResult
from tests.core.test_core_stateful import (
    BLOCK_SIZE,
    K_MAX,
    NUM_BLOCKS,
    PREFIXES,
    VOCAB,
    CoreMachine,
    FakeExecutor,
)

TENTATIVE = -1  # what a deeper proposal leaves in the head's KV until absorbed


class FakeHeadExecutor(FakeExecutor):
    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self.head: dict[int, int] = {}
        self.draft = self.head  # copy-on-write copies it with the target's

    def execute(self, batch: StepBatch) -> StepResult:
        for src, dst in batch.copies:
            for kv in (self.target, self.head):
                for offset in range(BLOCK_SIZE):
                    src_slot, dst_slot = src * BLOCK_SIZE + offset, dst * BLOCK_SIZE + offset
                    if src_slot in kv:
                        kv[dst_slot] = kv[src_slot]
                    else:
                        kv.pop(dst_slot, None)
        results = []
        for w in batch.seqs:
            if not w.draft_on:  # the target alone
                assert w.k == 0 and not w.draft_state and not w.draft_tokens, w
                self._write(self.target, w.block_table, w.start, w.tokens)
                tokens = [self.rng.randrange(0, VOCAB)] if w.sample else []
                forks = [self.rng.randrange(1, VOCAB) for _ in range(w.num_forks)]
                results.append(SeqResult(tokens, 0, 0, [], forks, []))
                continue
            assert w.draft_tokens == [] or w.draft_state, w  # lags only after a state
            assert w.draft_start + len(w.draft_tokens) == w.start, w
            if w.k:
                assert len(w.tokens) == 1 and int(w.draft_state) == w.draft_start - 1, w
                self._write(self.head, w.block_table, w.draft_start, w.draft_tokens)  # catch up
            proposals = [self.rng.randrange(1, VOCAB) for _ in range(w.k)]
            self._write(self.head, w.block_table, w.end - 1, [TENTATIVE] * (w.k - 1))
            self._write(self.target, w.block_table, w.start, w.tokens + proposals)
            if w.sample:
                accepted = self.rng.randint(0, w.k)
                tokens = proposals[:accepted] + [self.rng.randrange(0, VOCAB)]
                forks = [self.rng.randrange(1, VOCAB) for _ in range(w.num_forks)]
                absorbed = w.tokens + tokens[:-1]
            else:
                assert w.following >= 0, w
                accepted, tokens, forks, absorbed = 0, [], [], w.tokens
            carry = (w.sample and not w.k and w.draft_state
                     and w.end // BLOCK_SIZE == w.draft_start // BLOCK_SIZE)
            if carry:
                state, lag = w.draft_state, len(w.draft_tokens) + len(absorbed)
            else:
                first = w.start if w.k else w.draft_start
                self._write(self.head, w.block_table, first,
                            ([] if w.k else w.draft_tokens) + absorbed)
                state, lag = str(w.start + len(absorbed) - 1).encode(), 0
            results.append(SeqResult(tokens, w.k if w.sample else 0, accepted, [], forks, [],
                                     draft_state=state, draft_lag=lag))
        return StepResult(results, (len(batch.seqs), 0.01), [])


class HeadCoreMachine(CoreMachine):
    @initialize(seed=st.integers(0, 2**32 - 1))
    def setup(self, seed: int) -> None:
        super().setup(seed)
        config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_seqs=4,
                              max_step_tokens=12, max_context=48, spec_k=K_MAX)
        pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, model_identity=b"fake-head")
        self.core = EngineCore(config, pool, SpecPolicy(K_MAX, HEAD, adaptive=False), 48,
                               eos_token_ids=(0,))
        # k at random, even for a sequence the head keeps nothing for
        self.core.scheduler.speculate = lambda seq, batch: Speculation(self.rng.randint(0, K_MAX))
        self.core.policy.admits_draft = lambda request, batch: self.rng.random() < 0.7
        self.executor = FakeHeadExecutor(self.rng)
        self.lags = 0  # checks that found a sequence lagging
        self.headless = 0  # checks that found a sequence the head keeps nothing for

    @invariant()
    def pool_and_counters_agree(self) -> None:
        super().pool_and_counters_agree()
        if not hasattr(self, "core"):
            return
        pool = self.core.pool
        for seq in self.core.scheduler.running:
            if not seq.draft_on:
                assert seq.num_draft_computed == 0 and not seq.draft_state, seq
                self.headless += 1
                continue
            absorbed = seq.num_computed - HEAD.draft_lag(seq)
            if absorbed < seq.num_computed:  # lags within the block being filled only
                assert absorbed // BLOCK_SIZE == seq.num_computed // BLOCK_SIZE, seq
                self.lags += 1
            table = pool.block_table(seq.seq_id)
            for position in range(absorbed):
                slot = table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
                assert self.executor.head.get(slot) == seq.token_ids[position], (seq, position)
            if seq.num_computed:
                assert int(seq.draft_state) == absorbed - 1, seq


def test_the_head_rule_through_the_boundary() -> None:
    """Seeded long runs: preemption, forks, prefix-cache hits, accepted
    and rejected proposals, aborts, heads lagging, sequences the head keeps
    nothing for beside the others, all checked after every step."""
    totals = {"preemptions": 0, "cached": 0, "accepted": 0, "rejected": 0, "aborts": 0,
              "lags": 0, "headless": 0}
    for seed in range(12):
        rng = random.Random(seed)
        machine = HeadCoreMachine()
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
            else:
                machine.step()
            machine.pool_and_counters_agree()
        stats = machine.core.stats()
        totals["preemptions"] += stats.preemptions
        totals["cached"] += stats.prefix_cached_tokens
        totals["accepted"] += stats.accepted_tokens
        totals["rejected"] += stats.drafted_tokens - stats.accepted_tokens
        totals["aborts"] += stats.aborts
        totals["lags"] += machine.lags
        totals["headless"] += machine.headless
        machine.teardown()
    assert all(totals.values()), totals


HeadCoreMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_core_with_a_head_through_the_boundary = HeadCoreMachine.TestCase
