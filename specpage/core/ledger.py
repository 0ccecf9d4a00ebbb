"""The one writer of a sequence's KV state.

A sequence's counters (`num_computed`, `num_draft_computed`, its tokens and
logprobs) and its entry in the pool describe the same thing; every change to
either goes through these functions, and each checks after it that they
still agree. The scheduler reserves and frees blocks; only this module
allocates a prompt, commits, rolls back and forks.

The draft rules live here and nowhere else. A draft model holds KV for a
prefix of what the target holds. It catches up on the rest (`draft_span`)
in the steps where it proposes, and a position is committed only once both
models hold its KV (`num_commit`).

A draft head (DraftKind.HEAD, models/eagle3.py) reads the target's hidden
states, which nothing keeps past the step that computed them. Its input at
position p is the target's features at p and token p + 1, so after
verification it can absorb up to the last accepted proposal, and
`num_commit` is num_new + accepted. Its output at the last absorbed
position starts the next step's proposal, so it proposes only in a step
that computes one new token, from a state (`head_span`). In a step where
no sequence needs it, the head does not run at all: a sequence that does
not speculate may leave positions unabsorbed, and carries their tapped
states after its output in `Sequence.draft_state` (`num_draft_computed`
marks where they start); the next forward that runs the head over it
absorbs them first. The head lags only within the block the target is
filling, so every full block, the only kind the prefix cache shares,
holds the head's KV as well as the target's; `head_lag` says how far.

A head costs a sequence that does not speculate something each step all the
same (its tapped states carried, a block's positions absorbed), where a
draft model that does not run costs nothing. So the policy may leave the
head off a new sequence for its whole life (`Sequence.draft_on`, decided
when it is submitted and kept by its forks and across preemption): it never
speculates, the head neither absorbs nor carries anything for it, and its
blocks go into the prefix cache under a key of their own (`cache_salt`),
so that no sequence with the head is served blocks without its KV.

Two places where a head's KV is an approximation, which costs acceptance
only (the target verifies every token): a fork shares its parent's KV and
state at the last prompt position, which read the parent's first sampled
token rather than the fork's own; and a prefix-cache hit's last position
read the next token of the sequence that cached it, which differs from the
new prompt's only where the two diverge exactly at a block boundary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Seq

from specpage.core.block_pool import BlockPool
from specpage.core.request import Sequence
from specpage.core.step import DraftKind, SeqResult


def admit(pool: BlockPool, seq: Sequence) -> int:
    """Give a waiting sequence its blocks, sharing what the prefix cache
    holds; returns the cached positions. The draft starts from nothing:
    cached blocks vouch for the target's KV only."""
    cached = pool.allocate_prompt(seq.seq_id, seq.token_ids, cache_salt(seq))
    seq.num_computed = cached
    seq.num_draft_computed = 0
    seq.draft_state = b""
    check(pool, seq)
    return cached


def cache_salt(seq: Sequence) -> bytes:
    """The prefix-cache salt of seq's blocks: its request's, and for a
    sequence the head keeps nothing for, one that no request's salt is."""
    if seq.draft_on:
        return seq.request.cache_salt
    return hashlib.sha256(b"without the draft head\0" + seq.request.cache_salt).digest()


def release(pool: BlockPool, seq: Sequence) -> None:
    """Free a sequence's blocks (preempted, ended); it keeps its tokens and
    computes them again if it runs again."""
    pool.free(seq.seq_id)
    seq.num_computed = seq.num_draft_computed = 0
    seq.draft_state = b""


def draft_span(seq: Sequence, kind: DraftKind = DraftKind.MODEL) -> tuple[int, list[int]]:
    """Where the draft's KV ends, and the committed tokens it lacks from there."""
    start = seq.num_computed - draft_lag(seq, kind)
    return start, seq.token_ids[start : seq.num_computed]


def draft_lag(seq: Sequence, kind: DraftKind) -> int:
    """Committed positions the draft holds no KV for: a draft model's since it
    last proposed, a head's (head_lag) within the block being filled."""
    return head_lag(seq) if kind is DraftKind.HEAD else seq.num_computed - seq.num_draft_computed


def head_lag(seq: Sequence) -> int:
    """Committed positions a head has not absorbed (their tapped states follow
    its output in draft_state). Without a state it holds what the target
    holds: it absorbed its last forward's span whole, or the sequence was
    just admitted, and cached blocks hold the head's KV too."""
    return seq.num_computed - seq.num_draft_computed if seq.draft_state else 0


def head_span(seq: Sequence, num_new: int, k: int, kind: DraftKind) -> tuple[int, int]:
    """The (num_new, k) a step can run of what was scheduled. A head starts
    its proposals from its state, its output at the position before the
    newest token, which only the step computing that position leaves: so a
    span that would compute more than the newest token and propose (a
    recompute after preemption) stops one short instead, and the next step
    computes the newest token alone and proposes as scheduled then (k is
    kept, so a seeded sample is as it would be without the preemption). A
    sequence without a state (a prefix hit that left only its newest token)
    cannot propose, nor one the head keeps nothing for."""
    if kind is not DraftKind.HEAD or k == 0:
        return num_new, k
    if not seq.draft_on:
        return num_new, 0
    if num_new > 1:
        return num_new - 1, 0
    return num_new, k if seq.draft_state else 0


def num_commit(num_new: int, k: int, num_accepted: int,
               kind: DraftKind = DraftKind.MODEL) -> int:
    """Positions of a step both models now hold KV for. The target computed
    the num_new tokens and k proposals. A draft model computed the num_new
    tokens (if it proposed) and was fed all but its last proposal; without
    proposals it did not run, and lags by the num_new tokens. A head
    absorbed each position the target computed whose next token is known:
    the num_new tokens and the accepted proposals. Proposals no model made
    (DraftKind.NONE) leave the target's KV, all of it kept."""
    if kind is not DraftKind.MODEL:
        return num_new + num_accepted
    return num_new + min(num_accepted, max(k - 1, 0))


def apply(pool: BlockPool, seq: Sequence, num_new: int, k: int, done: SeqResult,
          kind: DraftKind = DraftKind.MODEL) -> None:
    """Commit what a step computed for seq; roll back the rest of its
    reservation once the step has sampled (its proposals were tried)."""
    start = seq.num_computed
    n = num_commit(num_new, k, done.num_accepted, kind)
    computed = seq.token_ids[start : start + num_new] + list(done.tokens[: n - num_new])
    pool.commit(seq.seq_id, computed[:n])
    if done.tokens or pool.num_tentative(seq.seq_id) > seq.num_uncomputed - n:
        # it sampled, or a head stopped short of the proposals reserved for it
        pool.rollback(seq.seq_id)
    seq.num_computed += n
    if kind is DraftKind.HEAD and seq.draft_on:
        assert done.draft_lag == 0 or done.draft_state, done
        seq.num_draft_computed = seq.num_computed - done.draft_lag
        seq.draft_state = done.draft_state
    elif k > 0 and kind is DraftKind.MODEL:  # the draft ran over the span: caught up
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
    child.draft_state = parent.draft_state
    child.draft_on = parent.draft_on
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
