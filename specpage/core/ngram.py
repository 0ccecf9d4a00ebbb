"""Counts of what followed each n-gram of some token text, for proposals
that need no model.

`NgramCounts` maps every n-gram of the text it was given (for n in
n_min..n_max) to the tokens that followed it and how often. Adding text is
work in proportion to the new tokens (one count per n per token), never a
rescan of what was added before, and text can be taken out again, so the
same table serves a sequence's own context (which only grows) and a cache
of earlier requests (which evicts).

`continuation` walks it: from the longest n-gram that ends the context and
occurred before, the most frequent follower, then the same from the context
with that token appended, while the chain stays likely. Each token's
confidence is its follower's share of what followed that n-gram, shrunk by
SHRINK pseudo-counts (one occurrence alone is a guess, not a certainty);
they are priors: the proposer (core/model_free.py) learns what verification
accepts of tokens found on the same evidence (each token's `Evidence`: the
length of the n-gram it followed, how often it followed, whether always).

Pure Python; no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NamedTuple

# Pseudo-counts against a follower: its share of n occurrences is
# count / (n + SHRINK), so a follower seen once scores 2/3, four times 8/9.
SHRINK = 0.5
# The chain stops where its product of confidences falls below this: past
# it, a proposal's tokens are almost never accepted, and each costs a
# verified position. (Low, as the confidences are priors: tokens found after
# long n-grams are accepted far more often than their counts alone say.)
MIN_CHAIN = 0.01
# Occurrences an Evidence tells apart: a follower seen 1, 2, or 3 or more times.
COUNT_CAP = 3


class Evidence(NamedTuple):
    """What a proposed token was found on."""

    n: int  # the length of the n-gram it followed
    times: int  # how often it followed it, up to COUNT_CAP
    always: bool  # whether it followed every occurrence of the n-gram


class Continuation(NamedTuple):
    tokens: list[int]
    confidence: list[float]  # per token: the chance it follows, given the ones before
    evidence: list[Evidence]  # per token


NO_CONTINUATION = Continuation([], [], [])

# Whether the next token a walk finds, with this confidence and evidence, is
# worth proposing (asked of each in turn: the proposer's floor for the first,
# its share of what the ones before promise for the rest); False ends the
# walk before it.
Keep = Callable[[float, Evidence], bool]


class Followers:
    """What followed one n-gram: each token's count, their total, and the
    likeliest, kept as counts change so that a lookup reads it without a
    scan. Of tokens tied on the highest count the likeliest is the latest
    to reach it (a text's most recent continuation); once counts are taken
    out, the first of them in the order they were first seen."""

    __slots__ = ("counts", "total", "best")

    def __init__(self, token: int) -> None:
        self.counts = {token: 1}
        self.total = 1
        self.best = token

    @classmethod
    def pair(cls, first: int, second: int) -> Followers:
        """What followed an n-gram seen twice: first, then second."""
        followers = cls(first)
        followers.add(second)
        return followers

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Followers) and self.counts == other.counts

    def add(self, token: int) -> int:
        """Count one more; returns 1 if the token is new here."""
        count = self.counts.get(token, 0) + 1
        self.counts[token] = count
        self.total += 1
        if count >= self.counts[self.best]:
            self.best = token
        return int(count == 1)

    def remove(self, token: int) -> int:
        """Count one less; returns 1 if the token is gone from here."""
        count = self.counts[token] - 1
        self.total -= 1
        if count:
            self.counts[token] = count
        else:
            del self.counts[token]
        if token == self.best and self.counts:
            self.best = max(self.counts, key=self.counts.__getitem__)
        return int(count == 0)


# An n-gram's key is its tokens packed into one integer, BITS apiece, the
# latest lowest: built a token at a time for n = 1, 2, ... ending at the same
# place, with no tuple made (a prompt's counting is most of the proposers'
# cost: docs/BENCHMARKS.md, model_free_cost). Exact for token ids below
# 2**BITS (every vocabulary specpage loads); larger ids would alias n-grams,
# which costs proposals, never outputs (verification decides).
BITS = 21
MAX_NGRAM = 32  # the longest n-gram matched (engine.spec_ngram_max at most)
MASKS = [(1 << (BITS * n)) - 1 for n in range(MAX_NGRAM + 1)]  # an n-gram's key in a longer one's


def entry_counts(entry: int | Followers) -> tuple[int, int, int]:
    """(likeliest follower, its count, the n-gram's total) of a table's entry
    (a token: an n-gram seen once)."""
    if isinstance(entry, int):
        return entry, 1, 1
    return entry.best, entry.counts[entry.best], entry.total


def proposal(n: int, best: int, count: int, total: int) -> tuple[int, float, Evidence]:
    """What a lookup found after an n-gram: (follower, confidence, evidence)."""
    return best, count / (total + SHRINK), Evidence(n, min(count, COUNT_CAP), count == total)


def tail_key(context: Seq[int], n: int) -> int:
    """The key of context's last n tokens (the oldest highest): masked with
    MASKS[m], the key of its last m."""
    key, end = 0, len(context)
    for back in range(n, 0, -1):
        key = key << BITS | context[end - back]
    return key


class NgramCounts:
    """n-gram -> {follower: count} for n in n_min..n_max. An n-gram seen
    once maps to its follower alone (most of a text's longer n-grams occur
    once), one seen more often to its Followers."""

    __slots__ = ("n_min", "n_max", "tables", "num_entries")

    def __init__(self, n_min: int, n_max: int) -> None:
        assert 1 <= n_min <= n_max, (n_min, n_max)
        self.n_min, self.n_max = n_min, n_max
        # per n (index n - n_min): n-gram key -> what followed it
        self.tables: list[dict[int, int | Followers]] = [
            {} for _ in range(n_max - n_min + 1)]
        self.num_entries = 0  # (n-gram, follower) pairs held: the memory they take

    def add(self, tokens: Seq[int], start: int, end: int | None = None) -> int:
        """Count the followers at positions start..end - 1 of tokens (each
        after the n-grams ending just before it; end: all of them). Returns
        the counts made."""
        made, n_min, n_max, tables = 0, self.n_min, self.n_max, self.tables
        for position in range(max(start, n_min), len(tokens) if end is None else end):
            follower = tokens[position]
            key = 0
            for n in range(1, min(n_max, position) + 1):
                key |= tokens[position - n] << (BITS * (n - 1))
                if n < n_min:
                    continue
                table = tables[n - n_min]
                entry = table.get(key)
                if entry is None:
                    table[key] = follower
                    self.num_entries += 1
                elif isinstance(entry, int):
                    table[key] = Followers.pair(entry, follower)
                    self.num_entries += entry != follower
                else:
                    self.num_entries += entry.add(follower)
                made += 1
        return made

    def remove(self, tokens: Seq[int]) -> None:
        """Take out the counts `add(tokens, 0)` made."""
        n_min, n_max, tables = self.n_min, self.n_max, self.tables
        for position in range(n_min, len(tokens)):
            follower = tokens[position]
            key = 0
            for n in range(1, min(n_max, position) + 1):
                key |= tokens[position - n] << (BITS * (n - 1))
                if n < n_min:
                    continue
                table = tables[n - n_min]
                entry = table[key]
                if isinstance(entry, int):
                    del table[key]
                    self.num_entries -= 1
                    continue
                self.num_entries -= entry.remove(follower)
                if entry.total == 1:
                    table[key] = next(iter(entry.counts))

    def next_token(self, context: Seq[int]) -> tuple[int, float, Evidence] | None:
        """The likeliest follower of the longest n-gram ending context that
        occurred: (token, confidence, evidence), or None."""
        longest = min(self.n_max, len(context))
        key = tail_key(context, longest)
        for n in range(longest, self.n_min - 1, -1):
            entry = self.tables[n - self.n_min].get(key & MASKS[n])
            if entry is not None:
                return proposal(n, *entry_counts(entry))
        return None

    def continuation(self, context: Seq[int], length: int,
                     keep: Keep | None = None) -> Continuation:
        return walk(self.next_token, self.n_max, context, length, keep)


def walk(next_token: Callable[[Seq[int]], tuple[int, float, Evidence] | None], n_max: int,
         context: Seq[int], length: int, keep: Keep | None = None) -> Continuation:
    """Up to `length` tokens likely to follow context, by asking next_token
    (of a table of n-grams up to n_max) while the chain's confidence stays
    above MIN_CHAIN and keep takes each token found."""
    tail = list(context[max(0, len(context) - n_max) :])
    found_after = Continuation([], [], [])
    chain = 1.0
    while len(found_after.tokens) < length:
        found = next_token(tail)
        if found is None:
            break
        token, p, evidence = found
        if keep is not None and not keep(p, evidence):
            break
        chain *= p
        if chain < MIN_CHAIN:
            break
        found_after.tokens.append(token)
        found_after.confidence.append(p)
        found_after.evidence.append(evidence)
        tail = tail[1:] + [token] if len(tail) == n_max else tail + [token]
    return found_after
