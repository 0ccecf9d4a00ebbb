"""The shared paged KV block pool: one block id addresses the same slots in
the draft's and the target's KV, so one block table per sequence serves both.

Every sequence owns a block table and two counters: ``num_committed`` slots
hold final KV, followed by ``num_tentative`` reserved slots at the tail
(uncomputed prompt tokens, or draft proposals awaiting verification).

- ``allocate_prompt`` looks the prompt up in the prefix cache, shares the
  cached blocks and reserves tentative slots for the rest.
- ``reserve`` adds tentative slots at the tail, copying a shared tail block
  first (copy-on-write); the copies come back as ``(src, dst)`` pairs for the
  model runners, which copy the KV of both models.
- ``commit`` turns the first tentative slots into committed ones and hashes
  every block that becomes full; ``rollback`` drops the remaining tentative
  slots and frees blocks that held only those. It never copies KV.
- ``fork`` shares all of a sequence's blocks with a new one; ``free`` releases
  them. Freed, hashed blocks stay in the prefix cache until the space is
  needed (least recently freed first).
- ``drop_behind`` releases the committed blocks wholly before a position,
  for a table whose layers attend within a window (core/layer_groups.py):
  their entries become ``HOLE``, and they stay in the prefix cache as freed
  blocks do.

Where a block goes matters to speed, not to results: the attention kernels
read a sequence's K and V block by block, and blocks that follow each other
in memory read faster than scattered ones (SmolLM2's shape, 30 layers'
caches read cold: a layer of one sequence at 300 positions 34 us with its
blocks in a row, 49 us scattered; docs/BENCHMARKS.md, "block_placement").
So a sequence's next block is the one after its last where that one is
free; a sequence that cannot go on so starts at the middle of the longest
run of free blocks (at its start where no live sequence's block precedes
it), so that sequences growing side by side keep room to grow; where no run
is MIN_RUN long, the block freed longest ago. Once no block is free, cached
blocks are evicted least recently freed first, as the prefix cache needs.

This module is pure Python and must not import torch.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import msgspec

from specpage.core.arith import cdiv

SeqId = Hashable
BlockKey = bytes
Copy = tuple[int, int]  # (src block, dst block)
HOLE = -1  # a table entry whose block drop_behind released

_encode = msgspec.msgpack.Encoder().encode

# A run of free blocks shorter than this is not worth starting a sequence in
# (where no longer one is, the block freed longest ago is taken instead).
MIN_RUN = 8
_RUN = b"\x01" * MIN_RUN  # a run's first MIN_RUN free flags
MAX_RUNS = 64  # runs compared at most for a sequence's start (BlockPool._placed)


class PoolError(Exception):
    """Base of every error the pool raises; the pool is unchanged after one."""


class UnknownSequenceError(PoolError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class DuplicateSequenceError(PoolError, ValueError):
    pass


class InvalidCountError(PoolError, ValueError):
    pass


class OutOfBlocksError(PoolError):
    """The pool cannot satisfy a request; ``missing`` blocks would be needed."""

    def __init__(self, missing: int, needed: int, available: int) -> None:
        super().__init__(
            f"out of KV blocks: need {needed}, {available} available ({missing} missing)"
        )
        self.missing = missing
        self.needed = needed
        self.available = available


class PoolStats(NamedTuple):
    total: int
    free: int  # never cached, or evicted: empty
    cached: int  # unreferenced but still in the prefix cache, reusable
    in_use: int  # referenced by at least one block table
    tentative: int  # in use and holding only tentative slots


def block_key(parent: BlockKey | None, token_ids: Sequence[int], extra: bytes) -> BlockKey:
    """Chained content key of one full block: H(parent key, token ids, extra)."""
    return hashlib.sha256(_encode((parent, tuple(token_ids), extra))).digest()


class _CacheEntry(NamedTuple):
    block: int
    parent: BlockKey | None
    token_ids: tuple[int, ...]
    extra: bytes


class _Sequence:
    __slots__ = ("block_table", "num_committed", "num_tentative", "token_ids", "keys", "extra")

    def __init__(self, extra: bytes) -> None:
        self.block_table: list[int] = []
        self.num_committed = 0
        self.num_tentative = 0
        self.token_ids: list[int] = []  # committed tokens only
        self.keys: list[BlockKey] = []  # content key of each full committed block
        self.extra = extra


class BlockPool:
    """Fixed-size KV blocks shared by a draft and a target model.

    ``model_identity`` names both models (weights digests, tokenizer) and goes
    into every cache key, so no other model pair ever hits these blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, model_identity: bytes = b"") -> None:
        if num_blocks < 1:
            raise InvalidCountError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise InvalidCountError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_identity = model_identity
        # blocks neither in use nor cached: a flag per block, their count,
        # and the order they were freed in (oldest first; an entry whose
        # block was taken since, out of turn, is passed over)
        self._is_free = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._freed = 0  # blocks made free so far (BlockPool._placed)
        self._look_again = 0  # the count from which _placed looks for runs again
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._refcount = [0] * num_blocks
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        # key -> the block and what its content must be
        self._cache: dict[BlockKey, _CacheEntry] = {}
        self._seqs: dict[SeqId, _Sequence] = {}

    # ------------------------------------------------------------------ queries

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        return tuple(self._get(seq_id).block_table)

    def num_committed(self, seq_id: SeqId) -> int:
        return self._get(seq_id).num_committed

    def num_tentative(self, seq_id: SeqId) -> int:
        return self._get(seq_id).num_tentative

    def committed_token_ids(self, seq_id: SeqId) -> tuple[int, ...]:
        return tuple(self._get(seq_id).token_ids)

    def sequence_ids(self) -> list[SeqId]:
        return list(self._seqs)

    @property
    def num_available_blocks(self) -> int:
        return self._num_free + len(self._evictable)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def stats(self) -> PoolStats:
        free, cached = self._num_free, len(self._evictable)
        tentative = sum(
            len(s.block_table) - cdiv(s.num_committed, self.block_size) for s in self._seqs.values()
        )
        return PoolStats(self.num_blocks, free, cached, self.num_blocks - free - cached, tentative)

    def prompt_blocks(self, num_tokens: int) -> int:
        """Blocks a prompt of this many tokens takes with no cache hit."""
        return cdiv(num_tokens, self.block_size)

    def blocks_needed(self, seq_id: SeqId, n: int) -> int:
        """Blocks that ``reserve(seq_id, n)`` would take from the pool."""
        seq = self._get(seq_id)
        self._check_count("n", n)
        return self._blocks_needed(seq, n)

    # ------------------------------------------------------------------ changes

    def cached_blocks(self, token_ids: Sequence[int], cache_salt: bytes = b"") -> int:
        """The leading blocks of a prompt that allocate_prompt would share
        from the prefix cache; changes nothing."""
        return len(self._lookup(token_ids, self.model_identity + cache_salt, len(token_ids))[0])

    def allocate_prompt(
        self, seq_id: SeqId, token_ids: Sequence[int], cache_salt: bytes = b"",
        lookup: bool = True, most_hits: int | None = None,
    ) -> int:
        """Add a sequence for a prompt; returns how many leading tokens are
        already computed (shared from the prefix cache, at most `most_hits`
        blocks; none unless lookup). The rest of the prompt gets tentative
        slots, committed as prefill computes them.

        At least the last prompt token is always left to compute, since its
        logits start the generation.
        """
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} already exists")
        if len(token_ids) == 0:
            raise InvalidCountError(f"sequence {seq_id!r}: empty prompt")
        size = self.block_size
        extra = self.model_identity + cache_salt
        most = (len(token_ids) - 1) // size if lookup else 0
        hits, keys = self._lookup(token_ids, extra, most if most_hits is None
                                  else min(most, most_hits))
        num_new = cdiv(len(token_ids), size) - len(hits)
        available = self.num_available_blocks - sum(1 for b in hits if b in self._evictable)
        if num_new > available:
            raise OutOfBlocksError(num_new - available, num_new, available)

        seq = _Sequence(extra)
        for block in hits:
            if self._refcount[block] == 0:
                del self._evictable[block]
            self._refcount[block] += 1
        table = list(hits)
        for _ in range(num_new):
            table.append(self._allocate(table[-1] if table else None))
        seq.block_table = table
        num_cached = len(hits) * size
        seq.num_committed = num_cached
        seq.num_tentative = len(token_ids) - num_cached
        seq.token_ids = list(token_ids[:num_cached])
        seq.keys = keys
        self._seqs[seq_id] = seq
        return num_cached

    def reserve(self, seq_id: SeqId, n: int) -> list[Copy]:
        """Add n tentative slots at the tail, all or nothing. Returns the
        copy-on-write copies made, as (src, dst) block pairs."""
        seq = self._get(seq_id)
        self._check_count("n", n)
        needed = self._blocks_needed(seq, n)
        if needed > self.num_available_blocks:
            available = self.num_available_blocks
            raise OutOfBlocksError(needed - available, needed, available)
        copies: list[Copy] = []
        if n == 0:
            return copies
        size = self.block_size
        table = seq.block_table
        end = seq.num_committed + seq.num_tentative
        if end % size and self._refcount[table[-1]] > 1:
            src = table[-1]
            dst = self._allocate(table[-2] if len(table) > 1 else None)
            self._refcount[src] -= 1  # still referenced by another table
            table[-1] = dst
            copies.append((src, dst))
        for _ in range(cdiv(end + n, size) - len(table)):
            table.append(self._allocate(table[-1] if table else None))
        seq.num_tentative += n
        return copies

    def commit(self, seq_id: SeqId, token_ids: Sequence[int]) -> None:
        """Turn the first len(token_ids) tentative slots into committed ones,
        holding these tokens; blocks that become full enter the prefix cache."""
        seq = self._get(seq_id)
        n = len(token_ids)
        if n > seq.num_tentative:
            raise InvalidCountError(
                f"sequence {seq_id!r}: cannot commit {n} slots, only {seq.num_tentative} reserved"
            )
        seq.num_committed += n
        seq.num_tentative -= n
        seq.token_ids.extend(token_ids)
        size = self.block_size
        for index in range(len(seq.keys), seq.num_committed // size):
            self._hash_block(seq, index)

    def rollback(self, seq_id: SeqId) -> None:
        """Drop every tentative slot; free blocks that held only those."""
        seq = self._get(seq_id)
        self._rollback(seq)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """A new sequence sharing all of the parent's (committed) blocks."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {child_id!r} already exists")
        if parent.num_tentative:
            raise InvalidCountError(
                f"sequence {parent_id!r}: cannot fork with {parent.num_tentative} tentative slots"
            )
        child = _Sequence(parent.extra)
        child.block_table = list(parent.block_table)
        child.num_committed = parent.num_committed
        child.token_ids = list(parent.token_ids)
        child.keys = list(parent.keys)
        for block in child.block_table:
            if block != HOLE:
                self._refcount[block] += 1
        self._seqs[child_id] = child

    def free(self, seq_id: SeqId) -> None:
        """Release a sequence's blocks; hashed ones stay cached until evicted."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        # The tail goes first, so the cache evicts a sequence's tail before
        # the prefix that other requests are more likely to share.
        for block in reversed(seq.block_table):
            if block != HOLE:
                self._release(block)

    def drop_behind(self, seq_id: SeqId, position: int) -> int:
        """Release the blocks wholly before `position` (committed ones only:
        it stops at the first tentative slot), leaving HOLE in their place;
        returns how many it released. For a table whose readers never look
        before `position` again."""
        seq = self._get(seq_id)
        self._check_count("position", position)
        table, dropped = seq.block_table, 0
        for index in range(min(position, seq.num_committed) // self.block_size):
            if table[index] != HOLE:
                self._release(table[index])
                table[index] = HOLE
                dropped += 1
        return dropped

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Assert every invariant of the pool (DESIGN.md, 'The shared pool')."""
        size = self.block_size
        holders = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            assert seq.num_committed >= 0 and seq.num_tentative >= 0, seq_id
            end = seq.num_committed + seq.num_tentative
            # tentative slots only at the tail: the table ends where they end
            assert len(seq.block_table) == cdiv(end, size), (seq_id, seq.block_table, end)
            assert len(seq.token_ids) == seq.num_committed, seq_id
            assert len(seq.keys) == seq.num_committed // size, seq_id
            parent: BlockKey | None = None
            for index, key in enumerate(seq.keys):
                tokens = seq.token_ids[index * size : (index + 1) * size]
                assert key == block_key(parent, tokens, seq.extra), (seq_id, index)
                block = seq.block_table[index]
                assert block == HOLE or self._block_key[block] in (None, key), (seq_id, index)
                parent = key
            # holes only among the committed blocks, none after a held one
            held = [b != HOLE for b in seq.block_table]
            assert held == sorted(held), (seq_id, seq.block_table)
            assert all(held[seq.num_committed // size :]), (seq_id, seq.block_table)
            for block in seq.block_table:
                if block != HOLE:
                    holders[block] += 1
        free = {b for b in range(self.num_blocks) if self._is_free[b]}
        assert len(free) == self._num_free, "the free count is wrong"
        assert free <= set(self._free), "a free block is missing from the free order"
        assert not free & self._evictable.keys(), "a block is both free and cached"
        for block in range(self.num_blocks):
            assert self._refcount[block] == holders[block], (block, self._refcount[block])
            if block in free:
                assert holders[block] == 0 and self._block_key[block] is None, block
            elif block in self._evictable:
                assert holders[block] == 0 and self._block_key[block] is not None, block
            else:
                assert holders[block] > 0, f"block {block} is lost"
        for key, entry in self._cache.items():
            assert self._block_key[entry.block] == key, (entry.block, key)
            assert key == block_key(entry.parent, entry.token_ids, entry.extra), entry.block
        assert sum(k is not None for k in self._block_key) == len(self._cache)

    # ------------------------------------------------------------------ internals

    def _get(self, seq_id: SeqId) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(
                f"unknown sequence {seq_id!r} (never allocated, or already freed)"
            ) from None

    @staticmethod
    def _check_count(name: str, value: int) -> None:
        if value < 0:
            raise InvalidCountError(f"{name} must be >= 0, got {value}")

    def _blocks_needed(self, seq: _Sequence, n: int) -> int:
        if n == 0:
            return 0
        size = self.block_size
        end = seq.num_committed + seq.num_tentative
        needed = cdiv(end + n, size) - len(seq.block_table)
        if end % size and self._refcount[seq.block_table[-1]] > 1:
            needed += 1  # copy-on-write of the shared tail block
        return needed

    def _allocate(self, after: int | None) -> int:
        """A block for a table whose last block is `after` (None: none):
        the one after it where that is free, else a free block placed as
        the module says, else the cached block freed longest ago."""
        if self._num_free:
            block = after + 1 if after is not None and after != HOLE else -1
            if not 0 <= block < self.num_blocks or not self._is_free[block]:
                block = self._placed()
            self._is_free[block] = 0
            self._num_free -= 1
        else:
            block, _ = self._evictable.popitem(last=False)
            key = self._block_key[block]
            assert key is not None
            del self._cache[key]
            self._block_key[block] = None
        self._refcount[block] = 1
        return block

    def _placed(self) -> int:
        """A free block for a sequence to start (or go on) from: the middle
        of the longest run of free blocks (of the first MAX_RUNS at least
        MIN_RUN long), or its start where no live sequence's block comes
        right before it; the block freed longest ago where no run is MIN_RUN
        long (then no run is looked for again until MIN_RUN more blocks have
        been freed: a pool whose free blocks lie scattered costs no scan of
        its flags at every block it gives)."""
        flags, best, longest, position = self._is_free, -1, 0, 0
        if self._freed >= self._look_again:
            for _ in range(MAX_RUNS):
                start = flags.find(_RUN, position)
                if start < 0:
                    break
                end = flags.find(0, start)
                position = end if end >= 0 else self.num_blocks
                if position - start > longest:
                    best, longest = start, position - start
            if best < 0:
                self._look_again = self._freed + MIN_RUN
        if best >= 0:
            if best > 0 and self._refcount[best - 1] > 0:
                return best + longest // 2
            return best
        return self._oldest_free()

    def _oldest_free(self) -> int:
        """The free block freed longest ago (there is one), out of the free order."""
        free = self._free
        while not self._is_free[free[0]]:  # taken out of turn since
            free.popleft()
        return free.popleft()

    def _release(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if self._block_key[block] is None:
                self._is_free[block] = 1
                self._num_free += 1
                self._freed += 1
                if len(self._free) >= 2 * self.num_blocks:  # mostly passed-over entries
                    self._free = deque(b for b in dict.fromkeys(self._free) if self._is_free[b])
                self._free.append(block)
            else:
                self._evictable[block] = None

    def _rollback(self, seq: _Sequence) -> None:
        keep = cdiv(seq.num_committed, self.block_size)
        table = seq.block_table
        while len(table) > keep:
            self._release(table.pop())
        seq.num_tentative = 0

    def _lookup(self, token_ids: Sequence[int], extra: bytes, most: int
                ) -> tuple[list[int], list[BlockKey]]:
        """The cached blocks of the prompt's leading full blocks, at most
        `most` of them, and their keys; none past the last token's block."""
        size = self.block_size
        hits: list[int] = []
        keys: list[BlockKey] = []
        parent: BlockKey | None = None
        for start in range(0, min(most, (len(token_ids) - 1) // size) * size, size):
            key = block_key(parent, token_ids[start : start + size], extra)
            entry = self._cache.get(key)
            if entry is None:
                break
            hits.append(entry.block)
            keys.append(key)
            parent = key
        return hits, keys

    def _hash_block(self, seq: _Sequence, index: int) -> None:
        size = self.block_size
        parent = seq.keys[-1] if seq.keys else None
        tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
        key = block_key(parent, tokens, seq.extra)
        seq.keys.append(key)
        block = seq.block_table[index]
        if key not in self._cache and self._block_key[block] is None:
            self._cache[key] = _CacheEntry(block, parent, tokens, seq.extra)
            self._block_key[block] = key
