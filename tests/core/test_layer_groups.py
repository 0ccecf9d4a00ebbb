"""Layer groups (core/layer_groups.py): which layers share a page, and the
pool's operations over one block table per group, sliding groups giving
back the blocks their window has left. Random interleavings of every
operation against simulated KV, as tests/core/test_block_pool_stateful.py
checks the plain pool, plus the cases by hand."""

from __future__ import annotations

import pytest
from hypothesis.stateful import initialize, invariant

from specpage.core.block_pool import HOLE, BlockPool, OutOfBlocksError
from specpage.core.layer_groups import GroupedPool, LayerGroups, layer_groups
from tests.core.test_block_pool_stateful import BLOCK_SIZE, NUM_BLOCKS, PoolMachine

WINDOW = 6  # keys a sliding layer's query sees: positions p - 5 .. p
GROUPS = LayerGroups(((1,), (0,), (2,)), (0, WINDOW, WINDOW))


def test_gemma3s_layers_fall_into_six_groups_of_three() -> None:
    windows = [0 if (layer + 1) % 6 == 0 else 512 for layer in range(18)]
    groups = layer_groups(windows)
    assert groups.size == 3 and groups.windows == (0,) + (512,) * 5
    assert groups.layers[0] == (5, 11, 17) and groups.layers[1] == (0, 1, 2)
    assert groups.place(11) == (0, 1) and groups.place(4) == (2, 1)
    assert sorted(layer for members in groups.layers for layer in members) == list(range(18))


def test_layers_that_attend_alike_are_one_group() -> None:
    assert layer_groups([0] * 4) == LayerGroups(((0, 1, 2, 3),), (0,))
    assert layer_groups([16] * 3).windows == (16,)
    # Qwen3 with its first layer global: groups of one
    assert layer_groups([0, 16, 16]).layers == ((0,), (1,), (2,))
    with pytest.raises(ValueError, match="at least one layer"):
        layer_groups([])
    with pytest.raises(ValueError, match="windows must be >= 0"):
        layer_groups([0, -1])


def grouped(num_blocks: int = 3 * NUM_BLOCKS) -> GroupedPool:
    return GroupedPool(BlockPool(num_blocks, BLOCK_SIZE, model_identity=b"target"), GROUPS)


def test_sliding_groups_give_back_what_the_window_leaves() -> None:
    pool = grouped()
    prompt = list(range(1, 11))  # 10 tokens: 3 blocks
    assert pool.allocate_prompt("a", prompt) == 0
    pool.commit("a", prompt)
    # a query at 10 sees 5..10: block 0 (positions 0-3) is behind every query to come
    tables = [pool.pool.block_table(("a", g)) for g in range(3)]
    assert HOLE not in tables[0] and [t[0] for t in tables[1:]] == [HOLE, HOLE]
    assert pool.stats().in_use == 3 + 2 + 2
    for token in range(11, 31):  # decode to 30 tokens: 8 blocks of the global group
        pool.reserve("a", 1)
        pool.commit("a", [token])
    # the sliding groups hold the blocks of positions 25..30: 6 and 7
    assert pool.stats().in_use == 8 + 2 + 2
    assert pool.block_tables("a")[1][:6] == [0] * 6  # holes read as block 0
    pool.check_integrity()
    pool.free("a")
    assert pool.stats().in_use == 0
    pool.check_integrity()


def test_a_prompt_shares_what_every_group_still_caches() -> None:
    pool = grouped()
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks and 2 more
    pool.allocate_prompt("a", prompt)
    pool.commit("a", prompt)
    first = pool.block_tables("a")[0]
    pool.free("a")  # every full block hashed and cached, the dropped ones too
    assert pool.allocate_prompt("b", prompt + [99]) == 16
    assert pool.block_tables("b")[0][:4] == first[:4]
    pool.check_integrity()
    pool.free("b")
    # a salt is a namespace in every group
    assert pool.allocate_prompt("c", prompt + [99], cache_salt=b"other") == 0
    pool.free("c")
    # a group that caches fewer of the blocks limits what every group shares
    pool = grouped()
    for group, committed in ((0, 18), (1, 8), (2, 18)):
        one = ("x", group)
        pool.pool.allocate_prompt(one, prompt, pool._salt(b"", group))
        pool.pool.commit(one, prompt[:committed])
        pool.pool.free(one)
    assert pool.allocate_prompt("y", prompt) == 8
    pool.check_integrity()


def test_a_prompt_that_does_not_fit_leaves_the_pool_as_it_was() -> None:
    pool = grouped(num_blocks=8)  # 3 groups: a 3-block prompt needs 9
    before = pool.stats()
    with pytest.raises(OutOfBlocksError, match="need 9, 8 available"):
        pool.allocate_prompt("a", list(range(1, 11)))
    assert pool.stats() == before and "a" not in pool
    pool.check_integrity()
    assert pool.allocate_prompt("a", list(range(1, 8))) == 0  # 2 blocks a group: 6
    with pytest.raises(OutOfBlocksError):
        pool.reserve("a", 8)  # 2 more blocks a group
    assert pool.stats().in_use == 6
    pool.check_integrity()


def test_a_fork_shares_the_holes_and_the_blocks() -> None:
    pool = grouped()
    prompt = list(range(1, 15))
    pool.allocate_prompt("a", prompt)
    pool.commit("a", prompt)
    pool.fork("a", "b")
    assert pool.block_tables("b") == pool.block_tables("a")
    pool.reserve("b", 1)  # the shared tail block is copied in every group
    pool.commit("b", [7])
    pool.check_integrity()
    pool.free("a")
    pool.free("b")
    assert pool.stats().in_use == 0


class GroupedPoolMachine(PoolMachine):
    """The plain pool's machine over a GroupedPool: every group's table
    must read the sequence's tokens, a sliding group's from the first
    position a query to come can see, and hold no block wholly behind it."""

    @initialize()
    def setup(self) -> None:
        self.pool = grouped()
        self.kv = [[None] * BLOCK_SIZE for _ in range(3 * NUM_BLOCKS)]
        self.committed = {}
        self.tentative = {}
        self.next_id = 0

    def tables(self, seq: int) -> list[tuple[int, ...]]:
        return [self.pool.pool.block_table((seq, g)) for g in range(3)]

    def seen_from(self, seq: int, group: int) -> int:
        window = GROUPS.windows[group]
        return 0 if not window else max(0, len(self.committed[seq]) - window + 1)

    def write(self, seq: int, start: int, values: list[int]) -> None:
        held = self.pool.num_committed(seq) + self.pool.num_tentative(seq)
        for g, table in enumerate(self.tables(seq)):
            for position, value in enumerate(values, start):
                assert 0 <= position < held
                assert position >= self.seen_from(seq, g), "a write behind the window"
                self.kv[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] = value

    def content(self, seq: int) -> list[int | None]:
        end = len(self.committed[seq]) + len(self.tentative[seq])
        return [self.kv[block][offset] for block in self.tables(seq)[0]
                for offset in range(BLOCK_SIZE)][:end]

    @invariant()
    def every_group_sees_the_sequences_tokens(self) -> None:
        for seq in self.committed:
            expected = self.committed[seq] + self.tentative[seq]
            for g, table in enumerate(self.tables(seq)):
                start = self.seen_from(seq, g)
                assert all(b == HOLE for b in table[: start // BLOCK_SIZE]), (seq, g, table)
                assert HOLE not in table[start // BLOCK_SIZE :], (seq, g, table)
                seen = [self.kv[table[p // BLOCK_SIZE]][p % BLOCK_SIZE]
                        for p in range(start, len(expected))]
                assert seen == expected[start:], (seq, g)


GroupedPoolMachine.TestCase.settings = PoolMachine.TestCase.settings
TestGroupedPool = GroupedPoolMachine.TestCase


def test_a_group_whose_hits_another_group_evicts_shares_none() -> None:
    """Group 1's new block evicts group 2's cached hit (the least recently
    used) before group 2 takes it: every group gives its blocks back and
    takes them again, sharing no more than the group that got least."""
    pool = grouped(num_blocks=9)
    prompt = list(range(1, 9))  # 2 full blocks
    for group in (2, 0, 1):  # group 2's blocks the least recently used
        one = ("x", group)
        pool.pool.allocate_prompt(one, prompt, pool._salt(b"", group))
        pool.pool.commit(one, prompt)
        pool.pool.free(one)
    junk = list(range(100, 108))
    pool.pool.allocate_prompt("junk", junk)
    pool.pool.commit("junk", junk)
    pool.pool.free("junk")  # 8 cached blocks, 1 free
    # the first try shares 2 blocks in groups 0 and 1, 1 in group 2
    assert pool.allocate_prompt("y", prompt + [50, 51, 52, 53]) == 4
    assert [pool.pool.num_committed(("y", g)) for g in range(3)] == [4, 4, 4]
    assert pool.stats().in_use == 9
    pool.check_integrity()
    pool.free("y")
    assert pool.stats().in_use == 0
