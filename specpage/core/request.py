"""Requests, their sampling parameters and their sequences (one per sample).

A sequence's tokens are its prompt followed by its output. Its KV state lives
in the pool: ``num_computed`` tokens are committed there (both models hold
their KV); the tokens after them are computed by the next step, the last
one being the newest sampled token, which no model has seen yet.
"""

from __future__ import annotations

import enum
import math
import random
import time
from collections import abc
from dataclasses import dataclass, field
from typing import Any

import msgspec


class ValidationError(ValueError):
    """A request field with a bad value; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


GREEDY_BELOW = 1e-5  # temperatures under this are greedy

# Stop conditions a request may give, by default. Matching costs a step the
# same for any number of stop strings (stop_matcher.py), but each string's
# characters are compiled per request and each stop token id is checked per
# token. OpenAI's API takes 4 stop strings, TGI's --max-stop-sequences
# defaults to 4, vLLM sets no bound: these leave room for chat templates and
# tool formats that need dozens.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all stop strings together
MAX_STOP_TOKEN_IDS = 256
# vLLM's and OpenAI's bounds on these fields.
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2]
MAX_LOGIT_BIAS = 100.0  # each bias lies in [-100, 100]
# Alternatives per position a request may ask log-probabilities of: OpenAI's
# top_logprobs bound, and vLLM's max_logprobs default.
MAX_TOP_LOGPROBS = 20


class StopLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Bounds on a request's stop conditions (engine.max_stop_* in the config)."""

    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS


DEFAULT_STOP_LIMITS = StopLimits()


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """The target's log-probabilities at one position (before temperature and
    any adjustment): the token there, its rank, and the likeliest tokens."""

    logprob: float
    rank: int  # 1 + the tokens the target found likelier
    top: list[tuple[int, float]]  # (token id, log-probability), likeliest first


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_tokens: int = 16
    temperature: float = 1.0  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    seed: int | None = None  # None draws one; sample i of n uses seed + i
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False  # log-probability of each chosen token (target, before temperature)
    # What the sample's history does to its logits, with vLLM's meanings
    # (speculation/sampler.py); these defaults leave them as they are.
    presence_penalty: float = 0.0  # minus this for each token in the output so far
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    # over prompt and output tokens: a positive logit / this, a negative one * this
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens under min_p x the likeliest's probability
    min_tokens: int = 0  # EOS, stop token ids and stop strings end nothing before this
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    top_logprobs: int = 0  # with logprobs: the likeliest tokens at each output position
    # the prompt's log-probabilities with this many alternatives per position
    # (None: none); such a request recomputes its prompt (core/ledger.py admit)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.seed == -1:  # OpenAI's and vLLM's clients send -1 for no seed
            msgspec.structs.force_setattr(self, "seed", None)

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows fp32: sample greedily, as vLLM does.
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether its logits depend on the tokens it holds."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def validate(self, limits: StopLimits = DEFAULT_STOP_LIMITS) -> None:
        self._validate_stop(limits)
        checks = (
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0,
             "must be a finite number >= 0"),
            ("top_p", not math.isnan(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 keeps every token)"),
            ("n", 1 <= self.n <= 64, "must be in 1..64"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63,
             "must be in 0..2^63-1 (-1: no seed)"),
            ("presence_penalty", _within(self.presence_penalty, MAX_PENALTY),
             f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
            ("frequency_penalty", _within(self.frequency_penalty, MAX_PENALTY),
             f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
            ("repetition_penalty",
             math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             "must be a finite number > 0 (1 is off)"),
            ("min_p", not math.isnan(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens,
             f"must be in 0..max_tokens ({self.max_tokens})"),
            ("top_logprobs", 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
             f"must be in 0..{MAX_TOP_LOGPROBS}"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"must be in 0..{MAX_TOP_LOGPROBS}"),
        )  # fmt: skip
        for name, ok, message in checks:
            if not ok:
                raise ValidationError(name, f"{message}, got {getattr(self, name)!r}")
        self._validate_logit_bias()

    def _validate_logit_bias(self, vocab_size: int | None = None) -> None:
        for token, bias in self.logit_bias.items():
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                ids = "ids are >= 0" if vocab_size is None else f"0..{vocab_size - 1}"
                raise ValidationError("logit_bias", f"token id {token} outside {ids}")
            if not _within(bias, MAX_LOGIT_BIAS):
                raise ValidationError("logit_bias", f"bias of token {token} must be in "
                                      f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")

    def validate_vocabulary(self, vocab_size: int) -> None:
        """The token ids it names exist in a vocabulary of vocab_size."""
        unknown = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        if unknown is not None:  # it could never be sampled
            raise ValidationError("stop_token_ids",
                                  f"token id {unknown} outside 0..{vocab_size - 1}")
        self._validate_logit_bias(vocab_size)

    def _validate_stop(self, limits: StopLimits) -> None:
        # Counts first: a message that quoted ten thousand stop strings would
        # not fit a gRPC status.
        strings, chars = len(self.stop), sum(map(len, self.stop))
        if strings > limits.max_stop_strings:
            raise ValidationError(
                "stop", f"at most {limits.max_stop_strings} stop strings, got {strings}")
        if chars > limits.max_stop_chars:
            raise ValidationError(
                "stop", f"at most {limits.max_stop_chars} characters in all, got {chars}")
        if not all(self.stop):
            raise ValidationError("stop", f"stop strings must not be empty, got {self.stop!r}")
        ids = len(self.stop_token_ids)
        if ids > limits.max_stop_token_ids:
            raise ValidationError(
                "stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got {ids}")
        if not all(t >= 0 for t in self.stop_token_ids):
            raise ValidationError("stop_token_ids", f"must be >= 0, got {self.stop_token_ids!r}")


def _within(value: float, bound: float) -> bool:
    return not math.isnan(value) and -bound <= value <= bound


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the model's context
    ABORT = "abort"
    TIMEOUT = "timeout"  # the request's deadline passed
    ERROR = "error"


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # method (core/model_free.py's Method) -> [drafted, accepted]
    by_method: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Timings:
    arrival: float = 0.0  # time.monotonic()
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Sequence:
    """One sample of a request. Its id is the pool's sequence id."""

    __slots__ = ("seq_id", "request", "index", "token_ids", "num_prompt", "num_computed",
                 "num_draft_computed", "draft_state", "draft_on", "status", "finish_reason",
                 "logprobs", "accepted", "tested", "model_free_accepted",
                 "model_free_expected", "detok", "grammar")  # fmt: skip

    def __init__(self, seq_id: int, request: Request, index: int, token_ids: list[int]) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids = token_ids  # prompt + output
        self.num_prompt = len(request.prompt_token_ids)
        self.num_computed = 0  # positions whose KV the target holds (committed)
        self.num_draft_computed = 0  # positions whose KV the draft holds; <= num_computed
        # a draft head's output at num_draft_computed - 1, then the target's
        # tapped states it has not absorbed (core/proposer_rules.py)
        self.draft_state = b""
        # whether the draft keeps KV for it: a head may be left off a
        # sequence for its whole life (core/proposer_rules.py)
        self.draft_on = True
        self.status = Status.WAITING
        self.finish_reason: FinishReason | None = None
        self.logprobs: list[float] = []
        self.accepted = 0.0  # decayed counts of its accepted and tested proposals
        self.tested = 0.0
        # decayed counts of its model-free proposals' accepted tokens and of
        # the accepted tokens their confidences promised (core/policy.py)
        self.model_free_accepted = 0.0
        self.model_free_expected = 0.0
        self.detok: object = None  # the engine's incremental detokenizer
        # core/grammar.py's SequenceGrammar when the request is constrained
        self.grammar: Any = None

    @property
    def output_token_ids(self) -> list[int]:
        """A copy: its length is num_output, which costs nothing."""
        return self.token_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Whether its prefill reports the prompt's log-probabilities: the
        first sample's, before its first output token."""
        return (self.request.params.prompt_logprobs is not None and self.index == 0
                and len(self.token_ids) == self.num_prompt)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def seed(self) -> int:
        assert self.request.seed is not None
        return self.request.seed + self.index

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.request.request_id!r}#{self.index}, {self.num_tokens} tokens)"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0  # lower runs first, as in vLLM
    deadline: float | None = None  # time.monotonic() past which the request is dropped
    arrival: float = field(default_factory=time.monotonic)
    seed: int | None = None
    sequences: list[Sequence] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    cache_salt: bytes = b""  # per-tenant prefix-cache isolation
    spec_k: int | None = None  # None: the engine's policy; else at most this k
    cache_text: bool = True  # False: keep the request's text out of the suffix cache
    # core/grammar.py's CompiledGrammar: what every sample's output must match
    grammar: Any = None
    aborted: bool = False
    num_ended: int = 0  # samples whose final output was emitted
    # params.prompt_logprobs: position i's, None at 0 (nothing predicts it);
    # filled as prefill computes the prompt
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])

    def __post_init__(self) -> None:
        self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(62)
        self.timings.arrival = self.arrival
        self.usage.prompt_tokens = len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return bool(self.sequences) and all(s.finished for s in self.sequences)


def validate_prompt(
    token_ids: abc.Sequence[int], vocab_size: int, max_context: int, field_name: str = "prompt"
) -> None:
    """field_name is what the caller called the prompt (the gRPC API's
    `text` or `token_ids`), so the error names a field it has."""
    if not token_ids:
        raise ValidationError(field_name, "must not be empty")
    if len(token_ids) >= max_context:
        raise ValidationError(
            field_name, f"{len(token_ids)} tokens do not fit the model's context of {max_context}"
        )
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValidationError(field_name, f"token id {bad} outside 0..{vocab_size - 1}")
