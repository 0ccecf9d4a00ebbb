"""The one writer of a sequence's KV state.

A sequence's counters (`num_computed`, `num_draft_computed`, its tokens and
logprobs) and its entry in the pool describe the same thing; every change to
either goes through these functions, and each checks after it that they
still agree. The scheduler reserves and frees blocks; only this module
allocates a prompt, commits, rolls back and forks.

What a step commits and what the ledger records of the draft differ by
proposer (a draft model, an EAGLE-3 head, none): the ledger asks the rules
of whoever proposed (core/proposer_rules.py), and writes what they answer.
The scheduler reserves exactly what a step runs, so a step that did not
sample leaves tentative only the positions the sequence has yet to compute;
a step that sampled tried its proposals, and the rest of its reservation is
rolled back.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from specpage.core.layer_groups import Pool
from specpage.core.proposer_rules import ProposerRules
from specpage.core.request import Sequence
from specpage.core.step import SeqResult


def admit(pool: Pool, seq: Sequence, rules: ProposerRules) -> int:
    """Give a waiting sequence its blocks, sharing what the prefix cache
    holds under the draft's salt for it; returns the cached positions. The
    draft starts from nothing: cached blocks vouch for the target's KV only.

    A sequence that still owes its prompt's log-probabilities takes no hit:
    they need the logits at every prompt position, which cached KV does not
    give, so it computes its whole prompt again (its blocks are then cached
    as anyone's)."""
    cached = pool.allocate_prompt(seq.seq_id, seq.token_ids, rules.cache_salt(seq),
                                  lookup=not seq.owes_prompt_logprobs)
    seq.num_computed = cached
    seq.num_draft_computed = 0
    seq.draft_state = b""
    check(pool, seq)
    return cached


def release(pool: Pool, seq: Sequence) -> None:
    """Free a sequence's blocks (preempted, ended); it keeps its tokens and
    computes them again if it runs again."""
    pool.free(seq.seq_id)
    seq.num_computed = seq.num_draft_computed = 0
    seq.draft_state = b""


def apply(pool: Pool, seq: Sequence, num_new: int, k: int, done: SeqResult,
          rules: ProposerRules) -> None:
    """Commit what a step computed for seq, by the rules of whoever proposed;
    roll back the rest of its reservation once the step has sampled (its
    proposals were tried)."""
    start = seq.num_computed
    n = rules.num_commit(num_new, k, done.num_accepted)
    computed = seq.token_ids[start : start + num_new] + list(done.tokens[: n - num_new])
    pool.commit(seq.seq_id, computed[:n])
    if done.tokens:
        pool.rollback(seq.seq_id)
    else:  # it reserved nothing it did not compute (a prompt's later chunks aside)
        assert pool.num_tentative(seq.seq_id) <= seq.num_uncomputed - n, (seq, n)
    seq.num_computed += n
    seq.num_draft_computed, seq.draft_state = rules.recorded(seq, k, done)
    check(pool, seq)


def append_output(seq: Sequence, tokens: Seq[int], logprobs: Seq[float]) -> None:
    """Tokens sampled for seq, after its stop rules cut them."""
    seq.token_ids.extend(tokens)
    seq.logprobs.extend(logprobs)


def fork(pool: Pool, parent: Sequence, child: Sequence) -> None:
    """child shares all of parent's committed blocks and its KV state."""
    pool.fork(parent.seq_id, child.seq_id)
    child.num_computed = parent.num_computed
    child.num_draft_computed = parent.num_draft_computed
    child.draft_state = parent.draft_state
    child.draft_on = parent.draft_on
    check(pool, child)


def check(pool: Pool, seq: Sequence) -> None:
    """The sequence's counters agree with the pool's."""
    committed = pool.num_committed(seq.seq_id)
    assert seq.num_computed == committed, (seq, seq.num_computed, committed)
    assert 0 <= seq.num_draft_computed <= seq.num_computed, (seq, seq.num_draft_computed)


def check_tokens(pool: Pool, seq: Sequence) -> None:
    """Also the committed tokens themselves (linear in the sequence: for
    tests), for a sequence between steps."""
    check(pool, seq)
    assert seq.num_computed <= seq.num_tokens, (seq, seq.num_computed)
    committed = pool.committed_token_ids(seq.seq_id)
    assert tuple(seq.token_ids[: seq.num_computed]) == committed, seq
