"""KV pages of one layer group each, so that sliding-window layers give
back what their window has left.

A model whose layers attend differently (Gemma 3: five sliding layers to
one global) splits its layers into groups of equal size, each group's
layers of one kind: Gemma 3 270M's 18 layers (15 sliding, 3 global) into 6
groups of 3. A page of the pool holds one group's K and V for block_size
positions; each sequence keeps a block table per group, all drawn from the
one pool (vLLM's hybrid allocator does the same). A sliding group's table
releases the pages that its window has left behind (`BlockPool.drop_behind`:
a query at position p reads p - window + 1 .. p, and every query to come is
at or past the committed positions), while the global group keeps all. At
32 streams of 4,096 positions that leaves Gemma 3 270M 27% of the KV one
table for every layer holds (`specpage kv-plan --window 512
--windowed-layers 15`).

Each group's table is a sequence of its own in the pool, under a cache salt
that names the group: prefix-cache keys never match across groups, and a
prompt shares the blocks that every group's cache holds. A model whose
layers all attend alike has one group, and the pool is used exactly as
before. Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import msgspec

from specpage.core.arith import cdiv
from specpage.core.block_pool import (
    BlockPool,
    Copy,
    OutOfBlocksError,
    PoolStats,
    SeqId,
)

_encode = msgspec.msgpack.Encoder().encode


class LayerGroups(msgspec.Struct, frozen=True):
    """A model's layers by the page they keep their KV in."""

    layers: tuple[tuple[int, ...], ...]  # per group its layers, ascending; groups of one size
    windows: tuple[int, ...]  # per group the keys a query sees back (0: all)

    @property
    def size(self) -> int:
        """Layers a page holds."""
        return len(self.layers[0])

    def place(self, layer: int) -> tuple[int, int]:
        """(group, index within the group's pages) of a layer."""
        for group, members in enumerate(self.layers):
            if layer in members:
                return group, members.index(layer)
        raise ValueError(f"layer {layer} is in no group")


def layer_groups(windows: Sequence[int]) -> LayerGroups:
    """Groups for layers that attend within these windows (per layer, 0:
    all): as large as divides the count of every kind, global groups first.
    One group where every layer attends alike."""
    if not windows:
        raise ValueError("a model needs at least one layer")
    if min(windows) < 0:
        raise ValueError(f"windows must be >= 0, got {min(windows)}")
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    size = math.gcd(*(len(members) for members in kinds.values()))
    layers: list[tuple[int, ...]] = []
    group_windows: list[int] = []
    for window in sorted(kinds):
        members = kinds[window]
        for start in range(0, len(members), size):
            layers.append(tuple(members[start : start + size]))
            group_windows.append(window)
    return LayerGroups(tuple(layers), tuple(group_windows))


class GroupedPool:
    """A BlockPool's interface over one block table per layer group per
    sequence (what the scheduler, the ledger and the core call), each a
    sequence of the one pool. Changes are all or nothing, as the pool's.
    Counters and the committed tokens are the same in every group; the
    first group's table is the one `block_table` gives (global layers)."""

    def __init__(self, pool: BlockPool, groups: LayerGroups) -> None:
        self.pool = pool
        self.groups = groups
        self.block_size = pool.block_size
        self.num_blocks = pool.num_blocks
        self._range = range(len(groups.windows))

    def _ids(self, seq_id: SeqId) -> list[Hashable]:
        return [(seq_id, g) for g in self._range]

    def _salt(self, cache_salt: bytes, group: int) -> bytes:
        return _encode((group, cache_salt))  # unambiguous, whatever the salt's bytes

    # ------------------------------------------------------------------ queries

    def __contains__(self, seq_id: SeqId) -> bool:
        return (seq_id, 0) in self.pool

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        return self.pool.block_table((seq_id, 0))

    def block_tables(self, seq_id: SeqId) -> list[list[int]]:
        """Every group's table, in group order, as the attention reads them:
        a released page (HOLE) as block 0, which no reader dereferences (a
        sliding layer's queries skip or mask the positions behind their
        window)."""
        return [[max(b, 0) for b in self.pool.block_table(i)] for i in self._ids(seq_id)]

    def num_committed(self, seq_id: SeqId) -> int:
        return self.pool.num_committed((seq_id, 0))

    def num_tentative(self, seq_id: SeqId) -> int:
        return self.pool.num_tentative((seq_id, 0))

    def committed_token_ids(self, seq_id: SeqId) -> tuple[int, ...]:
        return self.pool.committed_token_ids((seq_id, 0))

    @property
    def num_available_blocks(self) -> int:
        return self.pool.num_available_blocks

    def refcount(self, block: int) -> int:
        return self.pool.refcount(block)

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def blocks_needed(self, seq_id: SeqId, n: int) -> int:
        return sum(self.pool.blocks_needed(i, n) for i in self._ids(seq_id))

    def prompt_blocks(self, num_tokens: int) -> int:
        """Blocks a prompt of this many tokens takes with no cache hit."""
        return len(self._range) * cdiv(num_tokens, self.block_size)

    # ------------------------------------------------------------------ changes

    def allocate_prompt(self, seq_id: SeqId, token_ids: Sequence[int], cache_salt: bytes = b"",
                        lookup: bool = True) -> int:
        """BlockPool.allocate_prompt for every group, sharing the leading
        blocks that every group's cache holds. A group's new blocks may
        evict another group's cached ones before that group takes them:
        then every group gives its blocks back and takes again, sharing what
        the group that got least got (fewer each time, so it ends)."""
        hits = (min(self.pool.cached_blocks(token_ids, self._salt(cache_salt, g))
                    for g in self._range) if lookup else 0)
        while True:
            cached = self._allocate_groups(seq_id, token_ids, cache_salt, lookup, hits)
            if len(set(cached)) == 1:
                break
            self.free(seq_id)
            hits = min(cached) // self.block_size
        self._drop(seq_id)
        return cached[0]

    def _allocate_groups(self, seq_id: SeqId, token_ids: Sequence[int], cache_salt: bytes,
                         lookup: bool, hits: int) -> list[int]:
        """Each group's allocate_prompt, sharing at most `hits` blocks: the
        positions each shares; all or nothing."""
        done: list[Hashable] = []
        cached: list[int] = []
        try:
            for g, i in enumerate(self._ids(seq_id)):
                cached.append(self.pool.allocate_prompt(i, token_ids, self._salt(cache_salt, g),
                                                        lookup, most_hits=hits))
                done.append(i)
        except OutOfBlocksError:
            for i in done:
                self.pool.free(i)
            needed = self.prompt_blocks(len(token_ids)) - len(self._range) * hits
            available = self.pool.num_available_blocks
            raise OutOfBlocksError(max(1, needed - available), needed, available) from None
        return cached

    def reserve(self, seq_id: SeqId, n: int) -> list[Copy]:
        needed = self.blocks_needed(seq_id, n)
        available = self.pool.num_available_blocks
        if needed > available:
            raise OutOfBlocksError(needed - available, needed, available)
        return [copy for i in self._ids(seq_id) for copy in self.pool.reserve(i, n)]

    def commit(self, seq_id: SeqId, token_ids: Sequence[int]) -> None:
        for i in self._ids(seq_id):
            self.pool.commit(i, token_ids)
        self._drop(seq_id)

    def rollback(self, seq_id: SeqId) -> None:
        for i in self._ids(seq_id):
            self.pool.rollback(i)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        for parent, child in zip(self._ids(parent_id), self._ids(child_id), strict=True):
            self.pool.fork(parent, child)

    def free(self, seq_id: SeqId) -> None:
        for i in self._ids(seq_id):
            self.pool.free(i)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        for one in self.pool.sequence_ids():
            assert isinstance(one, tuple), one  # (sequence, group)
            first = (one[0], 0)
            assert self.pool.num_committed(one) == self.pool.num_committed(first)
            assert self.pool.num_tentative(one) == self.pool.num_tentative(first)

    def _drop(self, seq_id: SeqId) -> None:
        """Each sliding group's pages that no query to come reads."""
        committed = self.pool.num_committed((seq_id, 0))
        for g, window in enumerate(self.groups.windows):
            if window:
                self.pool.drop_behind((seq_id, g), max(0, committed - window + 1))


Pool = BlockPool | GroupedPool  # what the scheduler, the ledger and the core hold
