"""The one writer of a sequence's KV state.

A sequence's counters (`num_computed`, `num_draft_computed`, its tokens and
logprobs) and its entry in the pool describe the same thing; every change to
either goes through these functions, and each checks after it that they
still agree. The scheduler reserves and frees blocks; only this module
allocates a prompt, commits, rolls back and forks.

The draft-lag rule lives here and nowhere else: the draft holds KV for a
prefix of what the target holds. It catches up on the rest (`draft_span`)
in the steps where it proposes, and a position is committed only once both
models hold its KV (`num_commit`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from specpage.block_pool import BlockPool
from specpage.request import Sequence


def admit(pool: BlockPool, seq: Sequence) -> int:
    """Give a waiting sequence its blocks, sharing what the prefix cache
    holds; returns the cached positions. The draft starts from nothing:
    cached blocks vouch for the target's KV only."""
    cached = pool.allocate_prompt(seq.seq_id, seq.token_ids, seq.request.cache_salt)
    seq.num_computed = cached
    seq.num_draft_computed = 0
    check(pool, seq)
    return cached


def release(pool: BlockPool, seq: Sequence) -> None:
    """Free a sequence's blocks (preempted, ended); it keeps its tokens and
    computes them again if it runs again."""
    pool.free(seq.seq_id)
    seq.num_computed = seq.num_draft_computed = 0


def draft_span(seq: Sequence) -> tuple[int, list[int]]:
    """Where the draft's KV ends, and the committed tokens it lacks from there."""
    return seq.num_draft_computed, seq.token_ids[seq.num_draft_computed : seq.num_computed]


def num_commit(num_new: int, k: int, num_accepted: int) -> int:
    """Positions of a step both models now hold KV for: the target computed
    the num_new tokens and k proposals; the draft computed the num_new
    tokens (if it proposed) and was fed all but its last proposal. Without
    proposals the draft did not run, and lags by the num_new tokens."""
    return num_new + min(num_accepted, max(k - 1, 0))


def apply(pool: BlockPool, seq: Sequence, num_new: int, k: int, sampled: bool,
          new_tokens: Seq[int], num_accepted: int) -> None:
    """Commit what a step computed for seq; roll back the rest of its
    reservation once the step has sampled (its proposals were tried)."""
    start = seq.num_computed
    n = num_commit(num_new, k, num_accepted)
    computed = seq.token_ids[start : start + num_new] + list(new_tokens[: n - num_new])
    pool.commit(seq.seq_id, computed[:n])
    if sampled:
        pool.rollback(seq.seq_id)
    seq.num_computed += n
    if k > 0:  # the draft ran over the span: caught up
        seq.num_draft_computed = seq.num_computed
    check(pool, seq)


def append_output(seq: Sequence, tokens: Seq[int], logprobs: Seq[float]) -> None:
    """Tokens sampled for seq, after its stop rules cut them."""
    seq.token_ids.extend(tokens)
    seq.logprobs.extend(logprobs)


def fork(pool: BlockPool, parent: Sequence, child: Sequence) -> None:
    """child shares all of parent's committed blocks and its KV state."""
    pool.fork(parent.seq_id, child.seq_id)
    child.num_computed = parent.num_computed
    child.num_draft_computed = parent.num_draft_computed
    check(pool, child)


def check(pool: BlockPool, seq: Sequence) -> None:
    """The sequence's counters agree with the pool's."""
    committed = pool.num_committed(seq.seq_id)
    assert seq.num_computed == committed, (seq, seq.num_computed, committed)
    assert 0 <= seq.num_draft_computed <= seq.num_computed, (seq, seq.num_draft_computed)


def check_tokens(pool: BlockPool, seq: Sequence) -> None:
    """Also the committed tokens themselves (linear in the sequence: for
    tests), for a sequence between steps."""
    check(pool, seq)
    assert seq.num_computed <= seq.num_tokens, (seq, seq.num_computed)
    committed = pool.committed_token_ids(seq.seq_id)
    assert tuple(seq.token_ids[: seq.num_computed]) == committed, seq
