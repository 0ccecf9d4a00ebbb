"""Structured outputs: a request's constraint (a JSON schema, any JSON object,
a regex, a choice of strings or a grammar), compiled into a matcher over the
model's vocabulary (llguidance), and per sequence what the matcher allows.

The matcher follows a sequence's committed output only. Each step the core
asks it three things (core/engine_core.py): the tokens the grammar forces
next (proposed with no model: `forced`), how much of a proposal the grammar
admits (`admitted`: proposals are cut before the first token it forbids),
and the mask of every row the target samples, one per proposal token and
one after them (`masks`). A draft model or head proposing for a constrained
sequence asks it one more, in the executor's draft loop: what it may
propose after its proposals so far (`draft_mask`). Asking consumes a
proposal's tokens and rolls them back, so the matcher ends each step where
the committed output is.

Compiling runs on the request's preparing thread (engine/submission.py),
bounded by its source's size and by llguidance's own limits; a compiled
grammar is kept per source (a bounded LRU) and each sequence starts from a
copy of it. Pure Python beside llguidance; no torch.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Literal

import msgspec

from specpage.core.request import ValidationError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
# A constraint's source (schema text, regex, grammar, all choices together)
# may have this many bytes: an application's schema is a few kilobytes.
MAX_SOURCE_BYTES = 64 * 1024
MAX_CHOICES = 1024
CACHED_GRAMMARS = 128  # compiled grammars kept, least recently used dropped
# JSON as json.dumps writes it: one space after ',' and ':', none elsewhere.
# A model writes JSON this way unprompted, and with no free whitespace the
# grammar forces the punctuation between values (more tokens known without
# a model) and no sequence can loop on blank space.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ",
                     "key_separator": ": "}
# llguidance's limits on a grammar's work: the lexer's fuel when building a
# grammar and per mask, the grammar's size. A grammar past them is refused
# (building) or its sequence fails (a step), never stalls the engine.
LIMITS: dict[str, Any] = {"initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
          "max_grammar_size": 200_000, "max_lexer_states": 100_000}


class Constraint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a request's output must match. `field` is the request field that
    asked for it, named in any error about it."""

    kind: Kind
    source: str = ""  # schema (JSON text), regex or grammar; "" for json_object
    choices: tuple[str, ...] = ()  # for choice
    field: str = "constraint"

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        return (self.kind, self.source, self.choices)


def json_schema(schema: Any, field: str) -> Constraint:
    """A JSON-schema constraint from a schema given as an object or as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise ValidationError(field, f"the schema is not JSON: {error}") from None
    if not isinstance(schema, dict | bool):
        raise ValidationError(field, f"a JSON schema is an object, got {type(schema).__name__}")
    return Constraint("json_schema", json.dumps(schema), field=field)


class Grammars:
    """Compiles constraints over one tokenizer and keeps the compiled ones.
    Thread-safe: requests compile on the preparing threads."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits per row
        self.eos_token_ids = eos_token_ids
        self._tokenizer: Any = None  # llguidance's, made on first use
        self._compiled: OrderedDict[tuple[str, str, tuple[str, ...]], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations, cumulative (not cache hits)

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                if self.hf_tokenizer is None:
                    raise ValidationError("constraint", "the model has no tokenizer")
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size,
                    eos_token=list(self.eos_token_ids) or None)
            return self._tokenizer

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The constraint's grammar, compiled or from the cache; a
        ValidationError naming constraint.field if it cannot be."""
        import llguidance

        key = constraint.key
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
        tokenizer = self._llg_tokenizer()
        # the engine's EOS ids and llguidance's, at which its matcher stops
        ends = (*self.eos_token_ids, *tokenizer.eos_tokens)
        if found is not None:
            return CompiledGrammar(found, ends)
        source = _grammar_source(constraint)
        limits = llguidance.LLParserLimits(**LIMITS)
        # builds the grammar and its lexer (the GIL released meanwhile); a
        # grammar that cannot be built leaves the matcher in error
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=limits)
        if matcher.is_error():
            raise ValidationError(constraint.field, _clean(matcher.get_error()))
        with self._lock:
            self.num_compiled += 1
            self._compiled[key] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return CompiledGrammar(matcher, ends)


def _grammar_source(constraint: Constraint) -> str:
    """llguidance's grammar for the constraint, its size checked first."""
    import llguidance

    field, kind = constraint.field, constraint.kind
    size = len(constraint.source.encode()) + sum(len(c.encode()) for c in constraint.choices)
    if size > MAX_SOURCE_BYTES:
        raise ValidationError(field, f"{size} bytes exceed the limit of {MAX_SOURCE_BYTES}")
    make = llguidance.LLMatcher
    if kind == "json_object":
        return make.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        try:
            return make.grammar_from_json_schema(constraint.source, defaults=JSON_OPTIONS)
        except ValueError as error:
            raise ValidationError(field, f"the schema is not valid: {error}") from None
    if kind == "regex":
        if not constraint.source:
            raise ValidationError(field, "the regex must not be empty")
        return make.grammar_from_regex(constraint.source)
    if kind == "choice":
        if not constraint.choices:
            raise ValidationError(field, "give at least one choice")
        if len(constraint.choices) > MAX_CHOICES:
            raise ValidationError(field, f"at most {MAX_CHOICES} choices, "
                                  f"got {len(constraint.choices)}")
        if not all(constraint.choices):
            raise ValidationError(field, "choices must not be empty strings")
        alternatives = " | ".join(json.dumps(c) for c in constraint.choices)
        return make.grammar_from_lark(f"start: {alternatives}")
    if not constraint.source.strip():
        raise ValidationError(field, "the grammar must not be empty")
    source = _lark(constraint.source, field)
    return source if source.lstrip().startswith("{") else make.grammar_from_lark(source)


def _lark(grammar: str, field: str) -> str:
    """A grammar in Lark's syntax, from Lark or from GBNF (llama.cpp's,
    also what vLLM's EBNF grammars are written in: rules with `::=`);
    llguidance's own JSON form (guidance's `{"grammars": [...]}`) as it is."""
    if grammar.lstrip().startswith("{"):
        return grammar
    if "::=" not in grammar:
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return str(gbnf_to_lark(grammar))
    except Exception as error:  # the converter raises plain exceptions on bad input
        raise ValidationError(field, f"the GBNF grammar is not valid: {error}") from None


def _clean(message: str) -> str:
    """llguidance's message, on one line and of bounded length."""
    line = " ".join(message.split())
    return line if len(line) <= 500 else line[:497] + "..."


class CompiledGrammar:
    """A compiled grammar, from which each of a request's samples starts."""

    __slots__ = ("_matcher", "_eos")

    def __init__(self, matcher: Any, eos_token_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self._eos = frozenset(eos_token_ids)

    def start(self) -> SequenceGrammar:
        return SequenceGrammar(self._matcher.deep_copy(), self._eos)


class SequenceGrammar:
    """One sequence's matcher, at its committed output (see the module's doc)."""

    __slots__ = ("matcher", "eos")

    def __init__(self, matcher: Any, eos: frozenset[int]) -> None:
        self.matcher = matcher
        # never proposed: a matcher that consumed EOS is stopped, and rolling
        # it back does not restore it
        self.eos = eos

    def copy(self) -> SequenceGrammar:
        """A matcher of its own at the same place (a forked sample's)."""
        return SequenceGrammar(self.matcher.deep_copy(), self.eos)

    def take(self, token: int) -> str | None:
        """Consume a committed output token; None, or what the grammar found
        wrong (the sequence must end)."""
        if not self.matcher.consume_token(token):
            return _clean(self.matcher.get_error() or "the output left the grammar")
        return None

    @property
    def stopped(self) -> bool:
        """Whether the grammar is complete and admits nothing more but EOS."""
        return bool(self.matcher.is_stopped())

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar allows next with no alternative, at most limit."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        forced: list[int] = self.matcher.compute_ff_tokens()[:limit]
        return forced[: self._before_eos(forced)]

    def admitted(self, tokens: tuple[int, ...] | list[int]) -> int:
        """How many of tokens, from the first, the grammar admits, up to
        the first EOS (a complete grammar ends its sequence without one)."""
        tokens = list(tokens[: self._before_eos(tokens)])
        if not tokens:
            return 0
        return int(self.matcher.validate_tokens(tokens))

    def _before_eos(self, tokens: tuple[int, ...] | list[int]) -> int:
        return next((i for i, t in enumerate(tokens) if t in self.eos), len(tokens))

    def draft_mask(self, proposal: list[int]) -> bytes:
        """What a draft may propose after proposal (which the grammar must
        admit): the grammar's mask there without the EOS tokens (never
        proposed), one row as `masks` lays it out; no token at all where
        the matcher went past its limits."""
        matcher = self.matcher
        for token in proposal:
            if token in self.eos or not matcher.consume_token(token):
                raise ValueError(f"proposal token {token} is not admitted by the grammar")
        row = bytearray(matcher.compute_bitmask())
        if proposal:
            matcher.rollback(len(proposal))
        if matcher.is_error():
            return bytes(len(row))
        for token in self.eos:
            if token // 8 < len(row):
                row[token // 8] &= ~(1 << token % 8) & 0xFF
        return bytes(row)

    def masks(self, proposal: list[int]) -> bytes:
        """The allowed tokens of each row the target samples: after the
        committed output, then after each proposal token in turn (which the
        grammar must admit); one bit per token, 32 to a little-endian int32,
        rows one after another."""
        matcher = self.matcher
        rows = [matcher.compute_bitmask()]
        for token in proposal:
            if token in self.eos or not matcher.consume_token(token):
                raise ValueError(f"proposal token {token} is not admitted by the grammar")
            rows.append(matcher.compute_bitmask())
        if proposal:
            matcher.rollback(len(proposal))
        if matcher.is_error():
            # past llguidance's limits for a token: every row allows every
            # token rather than none, and the token sampled then ends the
            # sequence in error (take), its output cut where the grammar held
            return b"\xff" * sum(len(row) for row in rows)
        return b"".join(rows)
