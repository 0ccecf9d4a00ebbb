"""What earlier requests said, for proposals that need no model.

A bounded cache of finished requests' texts (their outputs, core/model_free.py),
counted as n-grams (core/ngram.py) in one table per cache salt: a request
is proposed continuations from the texts of its own salt's requests only
(requests without a salt share one namespace), so what one tenant's
requests accept says nothing of another's text. Whole texts are evicted,
the least recently added first, once the tokens held pass `max_tokens`
(a text's n-grams are counted in with it and counted out again); a
request may keep its text out (`Request.cache_text`).

Pure Python; no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from specpage.core.ngram import NO_CONTINUATION, Continuation, Keep, NgramCounts


class SuffixCache:
    def __init__(self, max_tokens: int, n_min: int, n_max: int) -> None:
        self.max_tokens = max_tokens
        self.n_min, self.n_max = n_min, n_max
        self.namespaces: dict[bytes, NgramCounts] = {}
        # (salt, text id) -> tokens, the least recently added first
        self.texts: OrderedDict[tuple[bytes, int], tuple[int, ...]] = OrderedDict()
        self.num_tokens = 0
        self._next_id = 0

    def add(self, salt: bytes, tokens: Seq[int]) -> None:
        """Keep a finished request's text for the requests of its salt."""
        if len(tokens) <= self.n_min or len(tokens) > self.max_tokens:
            return
        counts = self.namespaces.get(salt)
        if counts is None:
            counts = self.namespaces[salt] = NgramCounts(self.n_min, self.n_max)
        text = tuple(tokens)
        counts.add(text, 0)
        self.texts[salt, self._next_id] = text
        self._next_id += 1
        self.num_tokens += len(text)
        self._evict()

    def continuation(self, salt: bytes, context: Seq[int], length: int,
                     keep: Keep | None = None) -> Continuation:
        counts = self.namespaces.get(salt)
        if counts is None or length <= 0:
            return NO_CONTINUATION
        return counts.continuation(context, length, keep)

    def _evict(self) -> None:
        while self.num_tokens > self.max_tokens:
            (salt, _), text = self.texts.popitem(last=False)
            counts = self.namespaces[salt]
            counts.remove(text)
            self.num_tokens -= len(text)
            if not counts.num_entries:
                del self.namespaces[salt]

    def check_integrity(self) -> None:
        """The counts are exactly those of the texts held (linear: for tests)."""
        assert self.num_tokens == sum(map(len, self.texts.values())) <= self.max_tokens
        rebuilt: dict[bytes, NgramCounts] = {}
        for (salt, _), text in self.texts.items():
            rebuilt.setdefault(salt, NgramCounts(self.n_min, self.n_max)).add(text, 0)
        assert rebuilt.keys() == self.namespaces.keys()
        for salt, counts in rebuilt.items():
            assert counts.tables == self.namespaces[salt].tables, salt
