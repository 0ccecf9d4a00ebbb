"""Proposers that need no model: they read committed tokens, which only the
core holds, and their proposals travel in the step's batch for the target
to verify (no draft forward).

- `ngram` (prompt lookup): each sequence's own context (prompt and output so
  far) in an n-gram table that is brought up to date with the tokens added
  since the last proposal, longest match first (core/ngram.py).
- `suffix`: the outputs of earlier requests of the same cache salt
  (core/suffix_cache.py); a finished request's output goes in unless it
  opted out.
- `corpus`: a fixed table of the n-grams of the target's own answers to
  varied prompts (core/corpus.py), where the engine has one for the
  target's vocabulary: what the model itself says next where the context
  has no match.

Each token a method finds carries its chance of acceptance, learned from
what verification accepted of earlier tokens found on the same evidence
(core/chance.py). Per sequence, the method whose continuation promises more
accepted tokens proposes; the policy (core/policy.py) then decides how much
of it, if any, is worth verifying. Pure Python; no torch.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from specpage.core.chance import ChanceTable
from specpage.core.corpus import CorpusTable
from specpage.core.engine_config import EngineConfig
from specpage.core.ngram import Continuation, Evidence, NgramCounts
from specpage.core.request import FinishReason, Sequence
from specpage.core.suffix_cache import SuffixCache


class Method(enum.StrEnum):
    """Where a sequence's proposal came from (vLLM's names where they mean the same)."""

    DRAFT = "draft"  # the draft model or the EAGLE-3 head
    NGRAM = "ngram"
    SUFFIX = "suffix"
    CORPUS = "corpus"  # a fixed table of the target's own answers (core/corpus.py)
    # the tokens a request's grammar allows next with no alternative
    # (core/grammar.py): known without any model
    GRAMMAR = "grammar"


MODEL_FREE = (Method.NGRAM, Method.SUFFIX, Method.CORPUS)
# A proposal's token after the first whose chance of acceptance (given the
# ones before it, all accepted too) is below this share of the tokens the
# step already promises (1 + the chances of those before it) is not
# proposed, nor any after it (policy.py's _best_length): it could add at
# most 1% to the step's tokens. A proposer's walk ends there: at T 0.7 the
# chances fall by about a third a token, and walks of ~7 tokens fed
# proposals of 1 or 2.
LEAST_SHARE = 0.01


class Candidate(NamedTuple):
    method: Method
    tokens: list[int]
    # per token: the chance that it and every token before it are accepted
    chance: list[float]
    evidence: list[Evidence]  # per token: what it was found on


class Speculation(NamedTuple):
    """What a sequence proposes in a step, as the policy chose it."""

    k: int  # proposals
    tokens: tuple[int, ...] = ()  # a model-free proposal's k tokens; () when the draft makes k
    method: Method = Method.DRAFT
    expected: float = 0.0  # accepted tokens its confidences promise (model-free)
    evidence: tuple[Evidence, ...] = ()  # per model-free token: what it was found on

    def cut(self, k: int) -> Speculation:
        """At most k proposals."""
        if k >= self.k:
            return self
        if self.method is Method.DRAFT:
            return self._replace(k=k)
        if not k:
            return NO_SPECULATION
        return Speculation(k, self.tokens[:k], self.method, self.expected, self.evidence[:k])


NO_SPECULATION = Speculation(0)


class ModelFreeProposer:
    def __init__(self, config: EngineConfig, enabled: bool = True,
                 corpus: CorpusTable | None = None) -> None:
        """enabled: False keeps nothing and proposes nothing (speculation
        off); corpus: the `corpus` method's table (none: that method is off)."""
        self.max_tokens = config.model_free_k
        self.n_min, self.n_max = config.spec_ngram_min, config.spec_ngram_max
        self.methods = frozenset(Method(m) for m in config.model_free_methods
                                 if enabled and (m != Method.CORPUS or corpus is not None))
        self.corpus = corpus
        self.suffix = SuffixCache(config.spec_suffix_cache_tokens, self.n_min, self.n_max)
        self.contexts: dict[int, tuple[NgramCounts, int]] = {}  # seq_id -> (counts, indexed)
        self.num_counted = 0  # n-gram counts made for contexts, all sequences
        self.chances = ChanceTable()

    def propose(self, seq: Sequence, length: int | None = None,
                methods: frozenset[Method] | None = None, floor: float = 0.0,
                scale: float = 1.0) -> Candidate | None:
        """The likelier of seq's continuations, up to length (max_tokens)
        tokens, by the methods on (or those of them given). A seeded
        sample's comes from its own context only, with its confidences as
        chances: its tokens depend on what it proposes, which must not
        depend on other requests (the corpus table is no request's).
        floor: the chance of acceptance below which a continuation's first
        token is not worth the rest of its walk (the policy's
        model_free_lookup: no proposal starting with it could pay); such a
        continuation is none. Where there is a floor, a walk also ends at
        a later token that LEAST_SHARE turns down, its chance taken times
        scale (the policy's of this sequence)."""
        methods = self.methods if methods is None else self.methods & methods
        length = min(self.max_tokens if length is None else length,
                     seq.request.params.max_tokens - seq.num_output)
        if length <= 0:
            return None
        params = seq.request.params
        across = params.seed is None or params.greedy
        table = self.chances if across else None
        sampled = not params.greedy
        tokens = seq.token_ids
        best = None
        for method in MODEL_FREE:
            if method not in methods or (method is Method.SUFFIX and not across):
                continue
            keep = None if floor <= 0 else _Worth(floor, scale, method, table, sampled)
            if method is Method.NGRAM:
                found = self._context(seq).continuation(tokens, length, keep)
            elif method is Method.SUFFIX:
                found = self.suffix.continuation(seq.request.cache_salt, tokens, length, keep)
            else:
                assert self.corpus is not None
                found = self.corpus.continuation(tokens, length, keep)
            best = _likelier(best, _candidate(method, found, table, sampled))
        return best

    def observe(self, seq: Sequence, speculation: Speculation, accepted: int) -> None:
        """What verification accepted of seq's model-free proposal."""
        if speculation.evidence:
            self.chances.observe(speculation.method, not seq.request.params.greedy,
                                 speculation.evidence, accepted)

    def end(self, seq: Sequence, reason: FinishReason) -> None:
        """seq has ended: nothing of it stays but, unless it failed or its
        request keeps its text out, its output in the suffix cache (after
        the n_max prompt tokens before it, so that the output's first tokens
        are found after the prompt's end). Its prompt is not: a request's
        own prompt is looked up by prompt lookup, and counting every prompt
        in again costs a long prompt's worth of work for each request that
        ends; in the replay of bench/workloads the cache's proposals were
        accepted as often without them (docs/BENCHMARKS.md)."""
        self.contexts.pop(seq.seq_id, None)
        request = seq.request
        keep = request.cache_text and reason is not FinishReason.ERROR
        if keep and Method.SUFFIX in self.methods:
            self.suffix.add(request.cache_salt,
                            seq.token_ids[max(0, seq.num_prompt - self.n_max):])

    def index(self, seq: Sequence) -> None:
        """Bring seq's own n-gram counts up to its committed tokens, as a step
        commits them: a prompt is counted in by the steps that compute it,
        chunk by chunk, rather than all at once by the first step that
        decodes it (where, at 32 streams of 2,000-token prompts, it was
        most of the proposers' cost: docs/BENCHMARKS.md, model_free_cost).
        Nothing for a sequence that cannot propose from its context."""
        if Method.NGRAM in self.methods and seq.request.spec_k != 0:
            # (a step that ends a sequence inside an accepted run computed
            # positions past the tokens it keeps)
            self._context(seq, min(seq.num_computed, seq.num_tokens))

    def _context(self, seq: Sequence, end: int | None = None) -> NgramCounts:
        """seq's own n-gram counts, with the tokens added since last time (up
        to end; all of them if not given)."""
        end = seq.num_tokens if end is None else end
        entry = self.contexts.get(seq.seq_id)
        counts, indexed = entry if entry is not None else (
            NgramCounts(self.n_min, self.n_max), 0)
        if indexed < end:
            self.num_counted += counts.add(seq.token_ids, indexed, end)
            self.contexts[seq.seq_id] = (counts, end)
        return counts


class _Worth:
    """A walk's Keep where proposals are priced: its first token's chance of
    acceptance (as _candidate prices it) at least floor, each later one's
    (times scale, at most 1, as the policy takes it) at least LEAST_SHARE
    of the tokens those before it promise (summed as _best_length sums them)."""

    __slots__ = ("floor", "scale", "kind", "table", "chain", "tokens")

    def __init__(self, floor: float, scale: float, method: Method, table: ChanceTable | None,
                 sampled: bool) -> None:
        self.floor, self.scale, self.table = floor, scale, table
        self.kind = (method, sampled)
        self.chain = 1.0  # the chance that every token so far is accepted
        self.tokens = 0.0  # 1 + the scaled chains of the tokens so far; 0 before the first

    def __call__(self, confidence: float, evidence: Evidence) -> bool:
        chance = (confidence if self.table is None
                  else self.table.chance((*self.kind, evidence), confidence))
        self.chain *= chance
        scaled = min(1.0, self.chain * self.scale)
        if not self.tokens:
            self.tokens = 1.0 + scaled
            return self.chain >= self.floor
        if scaled < LEAST_SHARE * self.tokens:
            return False
        self.tokens += scaled
        return True


def _likelier(best: Candidate | None, found: Candidate | None) -> Candidate | None:
    """found where it promises more accepted tokens than best (or there is no best)."""
    if found is not None and (best is None or sum(found.chance) > sum(best.chance)):
        return found
    return best


def _candidate(method: Method, found: Continuation, table: ChanceTable | None,
               sampled: bool) -> Candidate | None:
    """found with its chances: learned (table), or its confidences alone (None)."""
    if not found.tokens:
        return None
    if table is not None:
        chance = table.chain(method, sampled, found.evidence, found.confidence)
    else:
        chance, chain = [], 1.0
        for p in found.confidence:
            chain *= p
            chance.append(chain)
    return Candidate(method, found.tokens, chance, found.evidence)
