"""What differs by proposer, one object per kind.

Three kinds of proposer meet the core, and each answers the same questions
its own way: what of a scheduled span it can run (`trim`), where its KV
ends and what it catches up on (`draft_lag`, `draft_span`, `catch_up`),
what its lag costs a proposal (`priced_lag`), what a step commits for both
models (`num_commit`), what the ledger records of it after a step
(`recorded`), under which salt a sequence's blocks are cached
(`cache_salt`), and whether it costs a sequence that does not propose
(`costs_while_idle`). The engine core holds the draft's rules (DRAFT_MODEL,
HEAD, or NO_MODEL without a draft) and hands them to the scheduler, the
policy and the ledger; a step whose proposals the core made itself
(core/model_free.py) follows `beside_model_free()`.

A draft model (DRAFT_MODEL) holds KV for a prefix of what the target holds.
It does not run for a sequence that does not propose, catches up on what it
missed in the steps where it proposes, and a position is committed only
once both models hold its KV.

An EAGLE-3 head (HEAD, models/eagle3.py) reads the target's hidden states,
which nothing keeps past the step that computed them. Its input at position
p is the target's features at p and token p + 1, so after verification it
can absorb up to the last accepted proposal. Its output at the last
absorbed position starts the next step's proposal, so it proposes only in a
step that computes one new token, from a state. In a step where no sequence
needs it, the head does not run at all: a sequence that does not speculate
may leave positions unabsorbed, and carries their tapped states after its
output in `Sequence.draft_state` (`num_draft_computed` marks where they
start); the next forward that runs the head over it absorbs them first. The
head lags only within the block the target is filling, so every full block,
the only kind the prefix cache shares, holds the head's KV as well as the
target's.

A head costs a sequence that does not speculate something each step all the
same (its tapped states carried, a block's positions absorbed), where a
draft model that does not run costs nothing. So the policy may leave the
head off a new sequence for its whole life (`Sequence.draft_on`, decided
when it is submitted and kept by its forks and across preemption): it never
speculates, the head neither absorbs nor carries anything for it, and its
blocks go into the prefix cache under a salt of their own, so that no
sequence with the head is served blocks without its KV.

Two places where a head's KV is an approximation, which costs acceptance
only (the target verifies every token): a fork shares its parent's KV and
state at the last prompt position, which read the parent's first sampled
token rather than the fork's own; and a prefix-cache hit's last position
read the next token of the sequence that cached it, which differs from the
new prompt's only where the two diverge exactly at a block boundary.

Where no model runs over a step's proposals (NO_MODEL: the core proposed
them, or there is no draft), the target's KV is all the step computes, and
all of it is kept; a draft model beside it lags by the step.

Pure Python; no torch.
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from specpage.core.model_free import Method, Speculation
from specpage.core.request import Sequence
from specpage.core.step import SeqResult

CatchUp = tuple[int, list[int]]  # (first position, the committed tokens from there)


class DraftRecord(NamedTuple):
    """What the ledger records of the draft after a step."""

    num_draft_computed: int
    draft_state: bytes


class ProposerRules(abc.ABC):
    """The answers that differ by proposer; see the module docstring."""

    # whether the proposer costs a sequence something in steps where it
    # does not propose for it (so that the policy may leave it off)
    costs_while_idle: ClassVar[bool]

    def draft_span(self, seq: Sequence) -> CatchUp:
        """Where the draft's KV ends, and the committed tokens it lacks from there."""
        start = seq.num_computed - self.draft_lag(seq)
        return start, seq.token_ids[start : seq.num_computed]

    @abc.abstractmethod
    def draft_lag(self, seq: Sequence) -> int:
        """Committed positions the draft holds no KV for."""

    @abc.abstractmethod
    def catch_up(self, seq: Sequence, k: int) -> CatchUp:
        """What the draft computes this step before the step's new tokens,
        when it makes k proposals: from where its KV ends, the committed
        tokens it runs over first."""

    @abc.abstractmethod
    def priced_lag(self, seq: Sequence) -> int:
        """Positions of the draft's lag a proposal pays for (core/policy.py)."""

    @abc.abstractmethod
    def trim(self, seq: Sequence, num_new: int,
             speculation: Speculation) -> tuple[int, Speculation]:
        """The (num_new, proposals) a step can run of what would be scheduled;
        the scheduler reserves exactly that."""

    @abc.abstractmethod
    def num_commit(self, num_new: int, k: int, num_accepted: int) -> int:
        """Positions of a step both models now hold KV for. The target
        computed the num_new tokens and k proposals."""

    @abc.abstractmethod
    def recorded(self, seq: Sequence, k: int, done: SeqResult) -> DraftRecord:
        """What the ledger records of the draft once the step's commit has
        moved seq.num_computed."""

    @abc.abstractmethod
    def cache_salt(self, seq: Sequence) -> bytes:
        """The prefix-cache salt of seq's blocks."""

    @abc.abstractmethod
    def beside_model_free(self) -> ProposerRules:
        """The rules of a step whose proposals the core made, beside this proposer."""


@dataclass(frozen=True)
class DraftModelRules(ProposerRules):
    """A draft model over tokens: lags where it does not run, catches up to propose."""

    costs_while_idle: ClassVar[bool] = False  # it does not run

    def draft_lag(self, seq: Sequence) -> int:
        """Since it last proposed."""
        return seq.num_computed - seq.num_draft_computed

    def catch_up(self, seq: Sequence, k: int) -> CatchUp:
        """All it lacks, when it proposes; without proposals it does not run."""
        return self.draft_span(seq) if k else (seq.num_computed, [])

    def priced_lag(self, seq: Sequence) -> int:
        """All of it: the first proposal's forward catches up."""
        return self.draft_lag(seq)

    def trim(self, seq: Sequence, num_new: int,
             speculation: Speculation) -> tuple[int, Speculation]:
        """All of it: a draft model runs what is scheduled."""
        return num_new, speculation

    def num_commit(self, num_new: int, k: int, num_accepted: int) -> int:
        """It computed the num_new tokens (if it proposed) and was fed all
        but its last proposal; without proposals it did not run, and lags by
        the num_new tokens."""
        return num_new + min(num_accepted, max(k - 1, 0))

    def recorded(self, seq: Sequence, k: int, done: SeqResult) -> DraftRecord:
        """Caught up, where it ran over the span."""
        return DraftRecord(seq.num_computed if k else seq.num_draft_computed, seq.draft_state)

    def cache_salt(self, seq: Sequence) -> bytes:
        """The request's: a cached block vouches for the target's KV only,
        and the draft starts from nothing after a hit."""
        return seq.request.cache_salt

    def beside_model_free(self) -> ProposerRules:
        """It does not run: it lags by the step."""
        return NO_MODEL


@dataclass(frozen=True)
class HeadRules(ProposerRules):
    """An EAGLE-3 head over the target's hidden states: lags within a block."""

    costs_while_idle: ClassVar[bool] = True  # it absorbs or carries every position

    def draft_lag(self, seq: Sequence) -> int:
        """Committed positions it has not absorbed (their tapped states follow
        its output in draft_state). Without a state it holds what the target
        holds: it absorbed its last forward's span whole, or the sequence
        was just admitted, and cached blocks hold the head's KV too."""
        return seq.num_computed - seq.num_draft_computed if seq.draft_state else 0

    def catch_up(self, seq: Sequence, k: int) -> CatchUp:
        """What it carries, proposing or not: a forward that runs the head
        over a sequence absorbs that first."""
        return self.draft_span(seq)

    def priced_lag(self, seq: Sequence) -> int:
        """None: it makes k proposals in k forwards as a draft model does,
        and absorbs what it missed once a block fills, whether it proposes
        or not; catching up to propose moves that forward earlier, so its
        lag costs a proposal nothing."""
        return 0

    def trim(self, seq: Sequence, num_new: int,
             speculation: Speculation) -> tuple[int, Speculation]:
        """A head starts its proposals from its state, its output at the
        position before the newest token, which only the step computing
        that position leaves: so a span that would compute more than the
        newest token and propose (a recompute after preemption) stops one
        short instead, and the next step computes the newest token alone
        and proposes as scheduled then (k is kept, so a seeded sample is as
        it would be without the preemption). A sequence without a state (a prefix hit that left
        only its newest token) cannot propose, nor one the head keeps
        nothing for. Proposals the core made need nothing of the head."""
        if speculation.method is not Method.DRAFT or speculation.k == 0:
            return num_new, speculation
        if not seq.draft_on:
            return num_new, speculation.cut(0)
        if num_new > 1:
            return num_new - 1, speculation.cut(0)
        return num_new, speculation if seq.draft_state else speculation.cut(0)

    def num_commit(self, num_new: int, k: int, num_accepted: int) -> int:
        """It absorbed each position the target computed whose next token is
        known: the num_new tokens and the accepted proposals."""
        return num_new + num_accepted

    def recorded(self, seq: Sequence, k: int, done: SeqResult) -> DraftRecord:
        """Its state, and where the positions it carries start; nothing for
        a sequence it keeps nothing for."""
        if not seq.draft_on:
            return DraftRecord(seq.num_draft_computed, seq.draft_state)
        assert done.draft_lag == 0 or done.draft_state, done
        return DraftRecord(seq.num_computed - done.draft_lag, done.draft_state)

    def cache_salt(self, seq: Sequence) -> bytes:
        """The request's, and for a sequence the head keeps nothing for, one
        that no request's salt is: its blocks hold no head KV."""
        if seq.draft_on:
            return seq.request.cache_salt
        return hashlib.sha256(b"without the draft head\0" + seq.request.cache_salt).digest()

    def beside_model_free(self) -> ProposerRules:
        """Its own: it absorbs the positions of any step that runs it."""
        return self


@dataclass(frozen=True)
class NoModelRules(ProposerRules):
    """No model runs over the proposals: the core's own, or no draft at all."""

    costs_while_idle: ClassVar[bool] = False

    def draft_lag(self, seq: Sequence) -> int:
        """None: no model of this step's proposer holds KV."""
        return 0

    def catch_up(self, seq: Sequence, k: int) -> CatchUp:
        """Nothing: no model runs."""
        return seq.num_computed, []

    def priced_lag(self, seq: Sequence) -> int:
        return 0

    def trim(self, seq: Sequence, num_new: int,
             speculation: Speculation) -> tuple[int, Speculation]:
        return num_new, speculation

    def num_commit(self, num_new: int, k: int, num_accepted: int) -> int:
        """The target's KV, all of it kept."""
        return num_new + num_accepted

    def recorded(self, seq: Sequence, k: int, done: SeqResult) -> DraftRecord:
        """Nothing new: a draft model beside it lags by the step."""
        return DraftRecord(seq.num_draft_computed, seq.draft_state)

    def cache_salt(self, seq: Sequence) -> bytes:
        return seq.request.cache_salt

    def beside_model_free(self) -> ProposerRules:
        return self


DRAFT_MODEL = DraftModelRules()
HEAD = HeadRules()
NO_MODEL = NoModelRules()
