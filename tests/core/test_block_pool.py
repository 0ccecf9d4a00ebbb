"""Unit tests of the block pool on small pools (block_size 4): exact block ids,
free-list order, copy-on-write pairs, and errors that leave the pool as it was."""

import copy
import sys

import pytest

from specpage.core.block_pool import (
    BlockPool,
    DuplicateSequenceError,
    InvalidCountError,
    OutOfBlocksError,
    PoolStats,
    UnknownSequenceError,
    block_key,
)


def snapshot(pool: BlockPool) -> dict:
    """Every field of the pool, sequences included, as plain values."""
    state = dict(vars(pool))
    state["_seqs"] = {
        seq_id: {name: getattr(seq, name) for name in seq.__slots__}
        for seq_id, seq in pool._seqs.items()
    }
    return copy.deepcopy(state)


def test_core_does_not_import_torch():
    assert "specpage.core.block_pool" in sys.modules
    code = "import sys, specpage.core.block_pool; assert 'torch' not in sys.modules"
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)


def test_prompt_allocation_takes_blocks_one_after_another():
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.allocate_prompt("a", [1, 2, 3, 4, 5, 6]) == 0
    assert pool.block_table("a") == (0, 1)
    assert pool.num_committed("a") == 0 and pool.num_tentative("a") == 6
    assert pool.allocate_prompt("b", [9] * 9) == 0
    assert pool.block_table("b") == (2, 3, 4)
    assert pool.stats() == PoolStats(total=8, free=3, cached=0, in_use=5, tentative=5)
    pool.check_integrity()


def test_reserve_commit_rollback_on_block_boundaries():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate_prompt("a", [1, 2, 3])
    pool.commit("a", [1, 2, 3])
    assert pool.stats().tentative == 0
    # k = 4: five tentative slots, positions 3..7, one new block
    assert pool.reserve("a", 5) == []
    assert pool.block_table("a") == (0, 1)
    pool.commit("a", [10, 11])  # two accepted
    pool.rollback("a")
    assert pool.block_table("a") == (0, 1)
    assert (pool.num_committed("a"), pool.num_tentative("a")) == (5, 0)
    assert pool.committed_token_ids("a") == (1, 2, 3, 10, 11)
    # a reservation that spills into two fresh blocks, all rejected
    pool.reserve("a", 7)
    assert pool.block_table("a") == (0, 1, 2)
    assert pool.stats().tentative == 1
    pool.rollback("a")
    assert pool.block_table("a") == (0, 1)
    # block 2 is free again, and the block after a's last: a goes on into it
    pool.reserve("a", 4)
    assert pool.block_table("a") == (0, 1, 2)
    pool.rollback("a")
    pool.allocate_prompt("b", [5] * 16)
    assert pool.block_table("b") == (2, 3, 4, 5)
    pool.check_integrity()


def test_rollback_frees_only_tentative_only_blocks():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate_prompt("a", [1, 2, 3, 4])
    pool.commit("a", [1, 2, 3, 4])
    pool.reserve("a", 5)
    assert pool.block_table("a") == (0, 1, 2)
    assert pool.stats().tentative == 2
    pool.rollback("a")
    assert pool.block_table("a") == (0,)
    assert pool.stats() == PoolStats(total=4, free=3, cached=0, in_use=1, tentative=0)


def test_prefix_cache_hit_shares_full_committed_blocks():
    pool = BlockPool(num_blocks=8, block_size=4)
    prompt = list(range(10))
    assert pool.allocate_prompt("a", prompt) == 0
    pool.commit("a", prompt)
    assert pool.block_table("a") == (0, 1, 2)
    # Same first two blocks, different tail.
    assert pool.allocate_prompt("b", prompt[:8] + [99]) == 8
    assert pool.block_table("b") == (0, 1, 3)
    assert pool.refcount(0) == 2 and pool.refcount(1) == 2 and pool.refcount(2) == 1
    assert pool.num_tentative("b") == 1
    pool.check_integrity()


def test_the_last_prompt_token_is_always_computed():
    pool = BlockPool(num_blocks=8, block_size=4)
    prompt = list(range(8))
    pool.allocate_prompt("a", prompt)
    pool.commit("a", prompt)
    # Both blocks are cached, but the last token's logits are needed.
    assert pool.allocate_prompt("b", prompt) == 4
    assert pool.block_table("b") == (0, 2)
    assert pool.num_tentative("b") == 4


def test_partial_and_tentative_blocks_are_never_cached():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate_prompt("a", [1, 2, 3, 4, 5, 6])
    pool.commit("a", [1, 2, 3, 4, 5])  # the second block is not full
    pool.reserve("a", 3)  # tentative slots fill it up
    assert pool.allocate_prompt("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
    pool.free("b")
    pool.free("a")
    # only a's first block was ever full and committed
    assert pool.stats() == PoolStats(total=8, free=7, cached=1, in_use=0, tentative=0)


def test_freed_blocks_stay_cached_and_are_evicted_lru():
    pool = BlockPool(num_blocks=5, block_size=4)
    for name, first in (("a", 100), ("b", 200)):
        prompt = [first + i for i in range(8)]
        pool.allocate_prompt(name, prompt)
        pool.commit(name, prompt)
    assert pool.block_table("a") == (0, 1) and pool.block_table("b") == (2, 3)
    pool.free("a")  # releases 1 then 0
    pool.free("b")  # releases 3 then 2
    assert pool.stats() == PoolStats(total=5, free=1, cached=4, in_use=0, tentative=0)
    # Empty blocks go first, then the least recently freed cached one.
    pool.allocate_prompt("c", [7] * 5)
    assert pool.block_table("c") == (4, 1)
    # a's head is still cached; its tail is gone; b's blocks are evicted next.
    assert pool.allocate_prompt("d", [100 + i for i in range(8)] + [0]) == 4
    assert pool.block_table("d") == (0, 3, 2)
    assert pool.stats() == PoolStats(total=5, free=0, cached=0, in_use=5, tentative=4)
    pool.check_integrity()


def test_cache_hit_on_an_evictable_block_revives_it():
    pool = BlockPool(num_blocks=3, block_size=4)
    prompt = [1, 2, 3, 4, 5]
    pool.allocate_prompt("a", prompt)
    pool.commit("a", prompt)
    pool.free("a")
    assert pool.stats() == PoolStats(total=3, free=2, cached=1, in_use=0, tentative=0)
    assert pool.allocate_prompt("b", prompt + [6, 7, 8, 9, 10, 11, 12]) == 4
    assert pool.block_table("b") == (0, 1, 2)
    pool.check_integrity()


def contiguous(table: tuple[int, ...]) -> bool:
    return all(b == a + 1 for a, b in zip(table, table[1:], strict=False))


def test_sequences_growing_side_by_side_keep_their_blocks_one_after_another():
    # As at 32 streams: prompts placed one after another, then every
    # sequence growing a token a step. Each starts in the middle of the
    # longest free run, so each grows into blocks of its own.
    pool = BlockPool(num_blocks=256, block_size=4)
    names = [f"s{i}" for i in range(8)]
    for i, name in enumerate(names):
        pool.allocate_prompt(name, [i] * 10)
        pool.commit(name, [i] * 10)
    for step in range(40):
        for name in names:
            pool.reserve(name, 1)
            pool.commit(name, [step])
    tables = [pool.block_table(name) for name in names]
    assert all(len(table) == 13 and contiguous(table) for table in tables), tables
    pool.check_integrity()


def test_a_sequence_that_cannot_go_on_in_place_starts_a_new_run():
    pool = BlockPool(num_blocks=64, block_size=4)
    pool.allocate_prompt("a", [1] * 8)
    pool.allocate_prompt("b", [2] * 8)  # from the middle of blocks 2..63
    assert pool.block_table("a") == (0, 1) and pool.block_table("b") == (33, 34)
    # 30 blocks: from the middle of 2..32 up to b's, then from the middle of 35..63
    pool.allocate_prompt("c", [3] * 4 * 30)
    assert pool.block_table("c") == tuple(range(17, 33)) + tuple(range(49, 63))
    pool.check_integrity()


def test_where_no_run_is_long_the_block_freed_longest_ago_is_taken():
    pool = BlockPool(num_blocks=6, block_size=1)
    for name in "abcdef":
        pool.allocate_prompt(name, [1])
    for name in "ecb":  # frees 4, 2, 1, in that order
        pool.free(name)
    pool.allocate_prompt("g", [1])
    assert pool.block_table("g") == (4,)
    pool.reserve("g", 1)  # 5 is taken: the next freed, 2
    assert pool.block_table("g") == (4, 2)
    pool.check_integrity()


def test_a_run_freed_after_scattered_blocks_is_found_again():
    pool = BlockPool(num_blocks=24, block_size=1)
    for i in range(24):
        pool.allocate_prompt(i, [1])
    holder = {pool.block_table(i)[0]: i for i in range(24)}
    for block in (3, 9, 15):  # scattered: no run to start in
        pool.free(holder[block])
    pool.allocate_prompt("x", [1])
    assert pool.block_table("x") == (3,)  # the block freed longest ago
    for block in range(12, 20):  # now 12..19 with 15 among them: a run of 8
        if block != 15:
            pool.free(holder[block])
    pool.allocate_prompt("y", [1])  # the run follows a live block: its middle
    assert pool.block_table("y") == (16,)
    pool.check_integrity()


def test_cache_salt_and_model_identity_separate_cache_entries():
    pool = BlockPool(num_blocks=8, block_size=4, model_identity=b"pair-1")
    prompt = list(range(9))
    pool.allocate_prompt("a", prompt, cache_salt=b"tenant-a")
    pool.commit("a", prompt)
    assert pool.allocate_prompt("b", prompt, cache_salt=b"tenant-b") == 0
    assert pool.allocate_prompt("c", prompt, cache_salt=b"tenant-a") == 8
    other = BlockPool(num_blocks=8, block_size=4, model_identity=b"pair-2")
    k1 = block_key(None, [0, 1, 2, 3], b"pair-1")
    k2 = block_key(None, [0, 1, 2, 3], b"pair-2")
    assert k1 != k2 and len(k1) == 32
    assert block_key(k1, [4, 5, 6, 7], b"") != block_key(k2, [4, 5, 6, 7], b"")
    assert other.allocate_prompt("a", prompt) == 0


def test_fork_shares_every_block_and_copies_on_first_write():
    pool = BlockPool(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]
    pool.allocate_prompt("p", prompt)
    pool.commit("p", prompt)
    pool.fork("p", "c")
    assert pool.block_table("c") == (0, 1)
    assert pool.refcount(0) == 2 and pool.refcount(1) == 2
    # The child writes into the shared, half-full tail block: it is copied.
    assert pool.reserve("c", 3) == [(1, 2)]
    assert pool.block_table("c") == (0, 2, 3)
    assert pool.refcount(1) == 1 and pool.refcount(2) == 1
    # The parent is now the only holder of block 1 and writes in place.
    assert pool.reserve("p", 2) == []
    assert pool.block_table("p") == (0, 1)
    pool.check_integrity()


def test_fork_of_full_blocks_needs_no_copy():
    pool = BlockPool(num_blocks=8, block_size=4)
    prompt = list(range(8))
    pool.allocate_prompt("p", prompt)
    pool.commit("p", prompt)
    pool.fork("p", "c")
    assert pool.reserve("c", 1) == []
    assert pool.block_table("c") == (0, 1, 2)


def test_free_everything_leaves_free_plus_cached_equal_total():
    pool = BlockPool(num_blocks=6, block_size=4)
    pool.allocate_prompt("a", list(range(9)))
    pool.commit("a", list(range(9)))
    pool.fork("a", "b")
    pool.reserve("b", 4)
    pool.free("a")
    pool.free("b")
    stats = pool.stats()
    assert stats.in_use == 0 and stats.free + stats.cached == stats.total
    pool.check_integrity()


def test_reserve_is_all_or_nothing_and_reports_missing_blocks():
    pool = BlockPool(num_blocks=3, block_size=4)
    pool.allocate_prompt("a", [1, 2])
    pool.commit("a", [1, 2])
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError) as info:
        pool.reserve("a", 15)  # needs 17 slots = 5 blocks, has 1
    assert (info.value.missing, info.value.needed, info.value.available) == (2, 4, 2)
    assert "2 missing" in str(info.value)
    assert snapshot(pool) == before
    assert pool.blocks_needed("a", 15) == 4


def test_prompt_allocation_is_all_or_nothing():
    pool = BlockPool(num_blocks=2, block_size=4)
    with pytest.raises(OutOfBlocksError) as info:
        pool.allocate_prompt("a", list(range(9)))
    assert info.value.missing == 1
    assert "a" not in pool
    assert pool.stats() == PoolStats(total=2, free=2, cached=0, in_use=0, tentative=0)


def test_copy_on_write_counts_toward_the_reservation():
    pool = BlockPool(num_blocks=2, block_size=4)
    pool.allocate_prompt("p", [1, 2])
    pool.commit("p", [1, 2])
    pool.fork("p", "c")
    assert pool.blocks_needed("c", 3) == 2  # the copy and one new block
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError) as info:
        pool.reserve("c", 3)
    assert info.value.missing == 1
    assert snapshot(pool) == before


@pytest.mark.parametrize(
    ("action", "error", "message"),
    [
        (lambda p: p.reserve("a", -1), InvalidCountError, "n must be >= 0, got -1"),
        (lambda p: p.blocks_needed("a", -2), InvalidCountError, "n must be >= 0, got -2"),
        (lambda p: p.commit("a", [1, 2, 3]), InvalidCountError, "only 2 reserved"),
        (lambda p: p.reserve("zz", 1), UnknownSequenceError, "unknown sequence 'zz'"),
        (lambda p: p.commit("zz", [1]), UnknownSequenceError, "unknown sequence 'zz'"),
        (lambda p: p.rollback("zz"), UnknownSequenceError, "unknown sequence 'zz'"),
        (lambda p: p.free("gone"), UnknownSequenceError, "already freed"),
        (lambda p: p.fork("gone", "x"), UnknownSequenceError, "unknown sequence 'gone'"),
        (lambda p: p.fork("a", "new"), InvalidCountError, "2 tentative slots"),
        (lambda p: p.fork("b", "a"), DuplicateSequenceError, "'a' already exists"),
        (lambda p: p.allocate_prompt("a", [1]), DuplicateSequenceError, "'a' already exists"),
        (lambda p: p.allocate_prompt("n", []), InvalidCountError, "empty prompt"),
    ],
)
def test_bad_input_raises_and_leaves_the_pool_unchanged(action, error, message):
    pool = BlockPool(num_blocks=6, block_size=4)
    pool.allocate_prompt("a", [1, 2, 3, 4, 5])
    pool.commit("a", [1, 2, 3])
    pool.allocate_prompt("b", [1, 2, 3, 4, 5])
    pool.commit("b", [1, 2, 3, 4, 5])
    pool.allocate_prompt("gone", [7])
    pool.free("gone")
    before = snapshot(pool)
    with pytest.raises(error, match=message):
        action(pool)
    assert snapshot(pool) == before
    pool.check_integrity()


def test_double_free_raises():
    pool = BlockPool(num_blocks=2, block_size=4)
    pool.allocate_prompt("a", [1])
    pool.free("a")
    with pytest.raises(UnknownSequenceError, match="already freed"):
        pool.free("a")
    assert pool.stats().free == 2


def test_bad_pool_shape_is_rejected():
    with pytest.raises(InvalidCountError, match="num_blocks"):
        BlockPool(num_blocks=0, block_size=4)
    with pytest.raises(InvalidCountError, match="block_size"):
        BlockPool(num_blocks=4, block_size=0)
