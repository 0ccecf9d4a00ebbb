"""The rules of each kind of proposer (pure Python), by exact values, and
the scheduler reserving exactly what a proposer runs."""

from __future__ import annotations

import hashlib

import pytest

from specpage.core import ledger
from specpage.core.block_pool import BlockPool
from specpage.core.engine_config import EngineConfig
from specpage.core.model_free import NO_SPECULATION, Method, Speculation
from specpage.core.proposer_rules import (
    DRAFT_MODEL,
    HEAD,
    NO_MODEL,
    DraftRecord,
    ProposerRules,
)
from specpage.core.request import Request, SamplingParams, Sequence
from specpage.core.scheduler import Scheduler
from specpage.core.step import SeqResult

PROMPT = list(range(10, 20))  # 10 tokens
MODEL_FREE = Speculation(2, (7, 8), Method.NGRAM, 1.5)


def sequence(outputs: int = 3, computed: int = 12, draft_computed: int = 9,
             state: bytes = b"", draft_on: bool = True) -> Sequence:
    """PROMPT and `outputs` sampled tokens; the target holds `computed` of
    them, the draft `draft_computed`."""
    request = Request("r", tuple(PROMPT), SamplingParams(max_tokens=50), cache_salt=b"tenant")
    seq = Sequence(0, request, 0, PROMPT + list(range(90, 90 + outputs)))
    request.sequences.append(seq)
    seq.num_computed, seq.num_draft_computed = computed, draft_computed
    seq.draft_state, seq.draft_on = state, draft_on
    return seq


def test_a_draft_model_lags_since_it_last_proposed_and_catches_up_to_propose():
    seq = sequence()  # 13 tokens, the target holds 12, the draft 9
    assert DRAFT_MODEL.draft_lag(seq) == 3
    assert DRAFT_MODEL.draft_span(seq) == (9, [19, 90, 91])
    assert DRAFT_MODEL.catch_up(seq, 2) == (9, [19, 90, 91])
    assert DRAFT_MODEL.catch_up(seq, 0) == (12, [])  # it does not run
    assert DRAFT_MODEL.priced_lag(seq) == 3
    # it was fed all but its last proposal: 1 new token + 2 of 3 accepted
    assert [DRAFT_MODEL.num_commit(1, 3, a) for a in range(4)] == [1, 2, 3, 3]
    assert DRAFT_MODEL.num_commit(5, 0, 0) == 5
    assert DRAFT_MODEL.trim(seq, 1, Speculation(3)) == (1, Speculation(3))
    assert DRAFT_MODEL.trim(seq, 4, Speculation(3)) == (4, Speculation(3))
    seq.num_computed = 15  # moved by a commit
    assert DRAFT_MODEL.recorded(seq, 3, SeqResult([1], 3, 0)) == DraftRecord(15, b"")
    assert DRAFT_MODEL.recorded(seq, 0, SeqResult([1])) == DraftRecord(9, b"")
    assert DRAFT_MODEL.cache_salt(seq) == b"tenant"
    assert not DRAFT_MODEL.costs_while_idle
    assert DRAFT_MODEL.beside_model_free() is NO_MODEL


def test_a_head_lags_by_what_it_carries_and_proposes_from_a_state_only():
    carrying = sequence(state=b"state", computed=12, draft_computed=9)
    assert HEAD.draft_lag(carrying) == 3
    assert HEAD.draft_span(carrying) == (9, [19, 90, 91])
    assert HEAD.catch_up(carrying, 0) == HEAD.catch_up(carrying, 2) == (9, [19, 90, 91])
    assert HEAD.priced_lag(carrying) == 0
    stateless = sequence(state=b"", computed=12, draft_computed=0)  # just admitted
    assert HEAD.draft_lag(stateless) == 0
    assert HEAD.catch_up(stateless, 2) == (12, [])
    # absorbs the new tokens and every accepted proposal
    assert [HEAD.num_commit(1, 3, a) for a in range(4)] == [1, 2, 3, 4]
    # one new token and a state: proposes as scheduled
    assert HEAD.trim(carrying, 1, Speculation(3)) == (1, Speculation(3))
    # a recompute that would propose stops one short, proposing nothing
    assert HEAD.trim(carrying, 13, Speculation(3)) == (12, NO_SPECULATION)
    assert HEAD.trim(carrying, 13, NO_SPECULATION) == (13, NO_SPECULATION)
    # no state, or a sequence it keeps nothing for: no proposals
    assert HEAD.trim(stateless, 1, Speculation(3)) == (1, NO_SPECULATION)
    off = sequence(state=b"", draft_computed=0, draft_on=False)
    assert HEAD.trim(off, 1, Speculation(3)) == (1, NO_SPECULATION)
    assert HEAD.trim(off, 4, Speculation(3)) == (4, NO_SPECULATION)
    # the core's own proposals need nothing of the head
    assert HEAD.trim(stateless, 13, MODEL_FREE) == (13, MODEL_FREE)
    carrying.num_computed = 15  # moved by a commit
    assert HEAD.recorded(carrying, 3, SeqResult([1], 3, 2, draft_state=b"next", draft_lag=1)
                         ) == DraftRecord(14, b"next")
    assert HEAD.recorded(carrying, 0, SeqResult(draft_state=b"s2")) == DraftRecord(15, b"s2")
    off.num_computed = 13
    assert HEAD.recorded(off, 0, SeqResult([1])) == DraftRecord(0, b"")
    with pytest.raises(AssertionError):  # a lag without the states it carries
        HEAD.recorded(carrying, 0, SeqResult(draft_lag=2))
    assert HEAD.cache_salt(carrying) == b"tenant"
    assert HEAD.cache_salt(off) == hashlib.sha256(b"without the draft head\0tenant").digest()
    assert HEAD.costs_while_idle
    assert HEAD.beside_model_free() is HEAD


def test_no_model_keeps_all_the_target_computed_and_records_nothing():
    seq = sequence(state=b"", computed=12, draft_computed=9)
    assert NO_MODEL.draft_lag(seq) == NO_MODEL.priced_lag(seq) == 0
    assert NO_MODEL.draft_span(seq) == NO_MODEL.catch_up(seq, 2) == (12, [])
    assert [NO_MODEL.num_commit(1, 3, a) for a in range(4)] == [1, 2, 3, 4]
    assert NO_MODEL.trim(seq, 13, MODEL_FREE) == (13, MODEL_FREE)
    seq.num_computed = 15
    assert NO_MODEL.recorded(seq, 2, SeqResult([7, 1], 2, 1)) == DraftRecord(9, b"")  # lags
    assert NO_MODEL.cache_salt(seq) == b"tenant"
    assert not NO_MODEL.costs_while_idle
    assert NO_MODEL.beside_model_free() is NO_MODEL


def recomputing(rules: ProposerRules) -> tuple[Scheduler, BlockPool, Sequence]:
    """A sequence with 5 outputs waiting to be recomputed (as after a
    preemption), for which the policy asks 3 proposals."""
    pool = BlockPool(64, 4)
    scheduler = Scheduler(EngineConfig(max_step_tokens=32, spec_k=3), 2048, pool,
                          lambda seq, batch: Speculation(3), rules)
    request = Request("r", tuple(PROMPT), SamplingParams(max_tokens=50))
    seq = Sequence(0, request, 0, PROMPT + [7, 7, 7, 7, 7])
    request.sequences.append(seq)
    scheduler.add(seq)
    return scheduler, pool, seq


def test_a_heads_recompute_reserves_exactly_what_it_runs():
    """A head cannot propose in the step that recomputes a preempted
    sequence: the scheduler reserves no slot for proposals it will not
    make, and the ledger has no surplus to roll back; the next step
    computes the newest token and reserves its proposals."""
    scheduler, pool, seq = recomputing(HEAD)
    [entry] = scheduler.schedule(now=0.0).scheduled
    assert (entry.num_new, entry.k, entry.speculation) == (14, 0, NO_SPECULATION)
    assert pool.num_tentative(seq.seq_id) == 15  # the 15 positions to compute, nothing more
    ledger.apply(pool, seq, entry.num_new, entry.k, SeqResult(draft_state=b"s"), HEAD)
    assert (seq.num_computed, pool.num_tentative(seq.seq_id)) == (14, 1)
    [entry] = scheduler.schedule(now=0.0).scheduled
    assert (entry.num_new, entry.k) == (1, 3)
    assert pool.num_tentative(seq.seq_id) == 1 + 3
    # a draft model runs what was asked: all of it and its proposals
    scheduler, pool, seq = recomputing(DRAFT_MODEL)
    [entry] = scheduler.schedule(now=0.0).scheduled
    assert (entry.num_new, entry.k) == (15, 3)
    assert pool.num_tentative(seq.seq_id) == 15 + 3


def test_a_step_that_did_not_sample_leaves_no_reservation_behind():
    """The ledger's check: a step that did not sample reserved nothing
    past the positions its sequence has yet to compute."""
    scheduler, pool, seq = recomputing(DRAFT_MODEL)
    ledger.admit(pool, seq, DRAFT_MODEL)
    pool.reserve(seq.seq_id, 3)  # proposals a step that stops short will not make
    with pytest.raises(AssertionError):
        ledger.apply(pool, seq, 14, 0, SeqResult(), DRAFT_MODEL)
