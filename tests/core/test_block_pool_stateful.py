"""Random interleavings of every pool operation, checked after each step.

KV is simulated: each block holds the token id written into each slot. A
sequence's content, read through its block table, must always be exactly its
committed tokens followed by its tentative ones, so another sequence's write
is never visible (copy-on-write isolation), and a prefix-cache hit must
return blocks that hold the very tokens it claims.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from specpage.core.block_pool import BlockPool, OutOfBlocksError

BLOCK_SIZE = 4
NUM_BLOCKS = 14
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 60], [70] * 12)
tokens = st.lists(st.integers(0, 99), max_size=10)


class PoolMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize()
    def setup(self) -> None:
        self.pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, model_identity=b"draft+target")
        self.kv: list[list[int | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.committed: dict[int, list[int]] = {}
        self.tentative: dict[int, list[int]] = {}
        self.next_id = 0

    # -- helpers ------------------------------------------------------------

    def write(self, seq: int, start: int, values: list[int]) -> None:
        held = self.pool.num_committed(seq) + self.pool.num_tentative(seq)
        for position, value in enumerate(values, start):
            assert 0 <= position < held, f"position {position} is outside sequence {seq}"
            block = self.pool.block_table(seq)[position // BLOCK_SIZE]
            self.kv[block][position % BLOCK_SIZE] = value

    def content(self, seq: int) -> list[int | None]:
        end = len(self.committed[seq]) + len(self.tentative[seq])
        return [
            self.kv[block][offset]
            for block in self.pool.block_table(seq)
            for offset in range(BLOCK_SIZE)
        ][:end]

    def apply_copies(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.kv[dst] = list(self.kv[src])

    def unchanged_after(self, error_call) -> None:
        before = (self.pool.stats(), {s: self.pool.block_table(s) for s in self.committed})
        try:
            error_call()
        except OutOfBlocksError as error:
            assert error.missing > 0
            after = (self.pool.stats(), {s: self.pool.block_table(s) for s in self.committed})
            assert after == before
            return
        raise AssertionError("expected OutOfBlocksError")

    # -- rules --------------------------------------------------------------

    @rule(target=seqs, prefix=st.sampled_from(PREFIXES), cut=st.integers(1, 12), tail=tokens,
          salt=st.sampled_from([b"", b"tenant"]))
    def allocate_prompt(self, prefix, cut, tail, salt):
        prompt = prefix[:cut] + tail
        seq = self.next_id
        self.next_id += 1
        try:
            cached = self.pool.allocate_prompt(seq, prompt, cache_salt=salt)
        except OutOfBlocksError:
            return multiple()
        assert cached % BLOCK_SIZE == 0 and cached < len(prompt)
        self.committed[seq] = prompt[:cached]
        self.tentative[seq] = prompt[cached:]
        # (c) the cached blocks hold exactly the prompt's leading tokens
        assert self.content(seq)[:cached] == prompt[:cached]
        self.write(seq, cached, prompt[cached:])  # prefill writes the rest
        return seq

    @rule(seq=seqs, data=st.data())
    def commit(self, seq, data):
        pending = self.tentative[seq]
        n = data.draw(st.integers(0, len(pending)))
        self.pool.commit(seq, pending[:n])
        self.committed[seq] += pending[:n]
        self.tentative[seq] = pending[n:]

    @rule(seq=seqs, drafts=tokens)
    def reserve_and_write(self, seq, drafts):
        start = len(self.committed[seq]) + len(self.tentative[seq])
        if self.pool.blocks_needed(seq, len(drafts)) > self.pool.num_available_blocks:
            self.unchanged_after(lambda: self.pool.reserve(seq, len(drafts)))
            return
        self.apply_copies(self.pool.reserve(seq, len(drafts)))
        self.write(seq, start, drafts)
        self.tentative[seq] += drafts

    @rule(seq=seqs)
    def rollback(self, seq):
        self.pool.rollback(seq)
        self.tentative[seq] = []

    @precondition(lambda self: any(not t for t in self.tentative.values()))
    @rule(target=seqs, data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(s for s, t in self.tentative.items() if not t)))
        child = self.next_id
        self.next_id += 1
        self.pool.fork(parent, child)
        self.committed[child] = list(self.committed[parent])
        self.tentative[child] = []
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        self.pool.free(seq)
        del self.committed[seq], self.tentative[seq]

    # -- invariants ---------------------------------------------------------

    @invariant()
    def pool_is_consistent(self):
        self.pool.check_integrity()

    @invariant()
    def every_sequence_sees_only_its_own_tokens(self):
        for seq in self.committed:
            assert self.content(seq) == self.committed[seq] + self.tentative[seq], seq
            assert self.pool.committed_token_ids(seq) == tuple(self.committed[seq])

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for seq in list(self.committed):
            self.pool.free(seq)
        self.pool.check_integrity()
        stats = self.pool.stats()
        # (a) nothing leaks
        assert stats.in_use == 0 and stats.free + stats.cached == stats.total


PoolMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPool = PoolMachine.TestCase
