"""A fixed table of the n-grams of a model's own answers, for proposals that
need no model (`corpus`).

Prompt lookup finds nothing where the context's last token never occurred
before in it (a new word, often its first piece), and the suffix cache
only what earlier requests of the same salt said. Much of what follows
there is still predictable from the model's habits: a word's next piece,
the phrase the model always continues with. So a table counted once, over
a corpus of the target's own answers to varied prompts (draft/snapshots,
made by draft/generate_data.py; `python -m draft.corpus_table`), proposes
the likeliest follower of the context's last 3, 2 or 1 tokens as the model
itself said it. As llama.cpp's static n-gram cache (`--lookup-cache-static`),
but counted over the model's answers rather than over a text corpus. It
holds no request's text, so every request may use it, whatever its salt.

Only what can pay is kept: every follower of single tokens, and of longer
n-grams the likeliest where it was seen at least LEAST times (most longer
n-grams of a corpus occur once, and a follower seen once after a 2- or
3-gram was accepted under a fifth of the time in a replay of
bench/workloads). Lookups walk the table as core/ngram.py walks a context,
with the same evidence (n-gram length, how often, whether always), whose
acceptance verification teaches core/chance.py per method.

A table belongs to one vocabulary: it records its tokenizer's fingerprint,
and a table whose fingerprint is not the target's is refused.

File: MAGIC, a JSON header line, then per n = 1..n_max its keys and values
as little-endian unsigned 64-bit arrays: a key is the n-gram packed as
core/ngram.py packs it, a value the follower | count << 21 | total << 42.

Pure Python; no torch.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any, BinaryIO

from specpage.core.config_error import ConfigError
from specpage.core.ngram import (
    BITS,
    MASKS,
    Continuation,
    Evidence,
    Keep,
    NgramCounts,
    entry_counts,
    proposal,
    tail_key,
    walk,
)

MAGIC = b"specpage n-gram table 1\n"
N_MAX = 3  # n-grams of up to 3 tokens: a key fits 63 bits
LEAST = 2  # times a longer n-gram's follower must have been seen to be kept
_FIELD = (1 << BITS) - 1  # a packed value's follower, count or total


class CorpusTableError(ConfigError):
    """engine.spec_corpus names a file that cannot be read as a table, or a
    table of another vocabulary than the target's."""


def vocabulary_fingerprint(tokenizer: Any) -> str:
    """A digest of the tokenizer's token -> id map: a table's tokens mean
    the same to every tokenizer with the same fingerprint."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


class CorpusTable:
    """n-gram -> its likeliest follower, that follower's count and the
    n-gram's total, for n in 1..n_max; read only."""

    __slots__ = ("n_max", "tables", "fingerprint", "tokens")

    def __init__(self, tables: list[dict[int, int]], fingerprint: str, tokens: int) -> None:
        if not 1 <= len(tables) <= N_MAX:
            raise CorpusTableError(f"a corpus table holds n-grams of 1..{N_MAX} tokens, "
                                   f"not {len(tables)}")
        self.n_max = len(tables)
        self.tables = tables  # index n - 1: key -> follower | count << BITS | total << 2 BITS
        self.fingerprint = fingerprint
        self.tokens = tokens  # the corpus's, counted

    @classmethod
    def count(cls, texts: Iterable[tuple[Seq[int], int]], fingerprint: str,
              n_max: int = N_MAX, least: int = LEAST) -> CorpusTable:
        """The table of texts, each (tokens, start): the followers at
        positions start.. (the tokens before start are context only: a
        prompt's end before its answer)."""
        counts = NgramCounts(1, n_max)
        tokens = 0
        for text, start in texts:
            counts.add(text, start)
            tokens += max(0, len(text) - start)
        tables: list[dict[int, int]] = []
        for n, table in enumerate(counts.tables, start=1):
            kept = {}
            for key, entry in table.items():
                best, count, total = entry_counts(entry)
                if n == 1 or count >= least:
                    kept[key] = _pack(best, count, total)
            tables.append(kept)
        return cls(tables, fingerprint, tokens)

    @property
    def num_entries(self) -> int:
        return sum(map(len, self.tables))

    def next_token(self, context: Seq[int]) -> tuple[int, float, Evidence] | None:
        """As NgramCounts.next_token: the likeliest follower of the longest
        n-gram ending context that the table holds."""
        longest = min(self.n_max, len(context))
        key = tail_key(context, longest)
        for n in range(longest, 0, -1):
            value = self.tables[n - 1].get(key & MASKS[n])
            if value is not None:
                return proposal(n, value & _FIELD, value >> BITS & _FIELD, value >> 2 * BITS)
        return None

    def continuation(self, context: Seq[int], length: int,
                     keep: Keep | None = None) -> Continuation:
        return walk(self.next_token, self.n_max, context, length, keep)

    def save(self, path: Path) -> None:
        header = {"vocabulary": self.fingerprint, "n_max": self.n_max, "tokens": self.tokens,
                  "entries": [len(t) for t in self.tables]}
        with path.open("wb") as out:
            out.write(MAGIC + json.dumps(header).encode() + b"\n")
            for table in self.tables:
                for column in (table.keys(), table.values()):
                    out.write(_little(array("Q", column)).tobytes())

    @staticmethod
    def fingerprint_of(path: Path) -> str:
        """The vocabulary fingerprint a table file records (its header alone is read)."""
        with _opened(path) as f:
            return _header(path, f.read(len(MAGIC)) + f.readline())[1]

    @classmethod
    def load(cls, path: Path) -> CorpusTable:
        with _opened(path) as f:
            data = f.read()
        at = data.find(b"\n", len(MAGIC)) + 1
        entries, fingerprint, tokens = _header(path, data[:at])
        body = memoryview(data)[at:]
        if len(body) != 16 * sum(entries):
            raise CorpusTableError(f"corpus table {path}: {len(body)} bytes of tables where "
                                   f"its header says {16 * sum(entries)}")
        tables, offset = [], 0
        for n in entries:
            keys, values = array("Q"), array("Q")
            keys.frombytes(body[offset:offset + 8 * n])
            values.frombytes(body[offset + 8 * n:offset + 16 * n])
            _little(keys)
            _little(values)
            tables.append(dict(zip(keys, values, strict=True)))
            offset += 16 * n
        return cls(tables, fingerprint, tokens)


def _opened(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except OSError as e:
        raise CorpusTableError(f"corpus table {path}: {e.strerror or e}") from None


def _header(path: Path, head: bytes) -> tuple[list[int], str, int]:
    """(entries per n, vocabulary fingerprint, tokens) of MAGIC + header line."""
    if not head.startswith(MAGIC):
        raise CorpusTableError(f"corpus table {path}: not a specpage n-gram table")
    try:
        header = json.loads(head[len(MAGIC):])
        return ([int(e) for e in header["entries"]], str(header["vocabulary"]),
                int(header["tokens"]))
    except (ValueError, KeyError, TypeError):
        raise CorpusTableError(f"corpus table {path}: its header is unreadable") from None


def _pack(best: int, count: int, total: int) -> int:
    return best | min(count, _FIELD) << BITS | min(total, _FIELD) << 2 * BITS


def _little(values: array[int]) -> array[int]:
    """values in (or from) little-endian order, in place."""
    if sys.byteorder != "little":
        values.byteswap()
    return values
