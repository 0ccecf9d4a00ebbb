"""What crosses between the core and the executor, as plain values.

A `StepBatch` says, per scheduled sequence, which positions each model
computes, in which blocks, with how many proposals and how to sample; a
`StepResult` says what came of it. Neither holds a `Sequence` or the pool,
so the executor can run anywhere a batch can be sent (msgspec encodes both).
"""

from __future__ import annotations

import msgspec

from specpage.core.request import GREEDY_BELOW, Sequence, TokenLogprobs


class Adjustments(msgspec.Struct, frozen=True, array_like=True):
    """What a sample's history does to its logits before it samples
    (speculation/sampler.py): penalties, a logit bias, tokens banned below
    min_tokens. A sample with none of them carries none."""

    presence: float  # presence_penalty
    frequency: float  # frequency_penalty
    repetition: float  # repetition_penalty, 1 is off
    logit_bias: dict[int, float]
    min_tokens: int
    banned: list[int]  # EOS and stop token ids, banned below min_tokens output tokens
    num_prompt: int
    # prompt then output, through the newest token; only when penalized (it
    # grows with the context, so a sample with no penalty sends none)
    history: list[int]


class Sampling(msgspec.Struct, frozen=True, array_like=True):
    """How one sample draws its tokens."""

    temperature: float
    top_k: int
    top_p: float
    seed: int  # this sample's own seed (the request's seed + its index)
    logprobs: bool  # report the chosen tokens' log-probabilities
    min_p: float = 0.0
    adjustments: Adjustments | None = None
    top_logprobs: int = 0  # with logprobs: the likeliest tokens at each chosen one's position

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def sampling_of(seq: Sequence, eos_token_ids: tuple[int, ...]) -> Sampling:
    """How seq samples its next token, once it holds what it holds now."""
    p = seq.request.params
    # past min_tokens (proposals only add tokens), nothing is banned any more
    banning = seq.num_tokens - seq.num_prompt < p.min_tokens
    adjustments = None
    if p.penalized or p.logit_bias or banning:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        adjustments = Adjustments(
            p.presence_penalty, p.frequency_penalty, p.repetition_penalty, dict(p.logit_bias),
            p.min_tokens, banned if banning else [], seq.num_prompt,
            list(seq.token_ids) if p.penalized else [])
    return Sampling(p.temperature, p.top_k, p.top_p, seq.seed, p.logprobs, p.min_p,
                    adjustments, p.top_logprobs if p.logprobs else 0)


class SeqWork(msgspec.Struct, frozen=True, array_like=True):
    """One sequence's share of a step."""

    seq_id: int
    start: int  # positions the target holds KV for before this step
    tokens: list[int]  # what the target computes, at positions start .. start + len - 1
    block_table: list[int]  # covers every position written this step
    sample: bool  # the span reaches the newest token: sample what follows it
    k: int  # proposals the draft makes (0 unless sample)
    draft_start: int  # positions the draft holds KV for (<= start)
    draft_tokens: list[int]  # positions draft_start .. start - 1: the draft catches up on them
    sampling: Sampling
    num_forks: int = 0  # further samples drawing their first token from these logits
    following: int = -1  # the token at position end, when the span stops short of the newest
    # a head's output at draft_start - 1, then the target's tapped states at
    # draft_start .. start - 1, which it has not absorbed yet; fp32 (see core/proposer_rules.py)
    draft_state: bytes = b""
    draft_on: bool = True  # False: the head keeps nothing for this sequence
    # the core's own proposal (core/model_free.py), k tokens, or [] when the
    # draft proposes k; the executor only verifies it, as if drawn with certainty
    proposal: list[int] = []
    # -1, or the span is prompt only and the log-probabilities of the prompt
    # tokens its positions predict (tokens[1:], then following) are wanted,
    # with this many alternatives each
    prompt_logprobs: int = -1
    # a constrained sequence's allowed tokens (core/grammar.py's masks) at
    # each row it samples, k + 1 of them; b"" when unconstrained
    allowed: bytes = b""
    # the target's block tables of its other layer groups (core/layer_groups.py;
    # block_table is the first group's); none where one table serves every layer
    group_tables: list[list[int]] = []

    @property
    def end(self) -> int:
        """Positions computed once the span is done; where a proposal at depth 0 goes."""
        return self.start + len(self.tokens)


class StepBatch(msgspec.Struct, frozen=True, array_like=True):
    seqs: list[SeqWork]
    copies: list[tuple[int, int]]  # copy-on-write (src, dst) blocks, in both models


class SeqResult(msgspec.Struct, frozen=True, array_like=True):
    """What one sequence's share produced. Empty when it did not sample,
    but for a head's draft_state."""

    tokens: list[int] = []  # accepted proposals, then the recovered or bonus token
    num_proposed: int = 0
    num_accepted: int = 0
    logprobs: list[float] = []  # of tokens, when asked for
    fork_tokens: list[int] = []  # first tokens of samples 1..n-1
    fork_logprobs: list[float] = []  # theirs, when asked for
    top_logprobs: list[list[tuple[int, float]]] = []  # per token, when asked for
    fork_top_logprobs: list[list[tuple[int, float]]] = []
    # of the prompt tokens the span predicts (SeqWork.prompt_logprobs), in order
    prompt_logprobs: list[TokenLogprobs] = []
    # a head's output at the last position it absorbed, then the tapped states
    # of the draft_lag positions after it that it has not; fp32 (core/proposer_rules.py)
    draft_state: bytes = b""
    draft_lag: int = 0


Cost = tuple[int, float]  # (positions in a forward, seconds it took)


class StepResult(msgspec.Struct, frozen=True, array_like=True):
    seqs: list[SeqResult]  # in the batch's order
    target_cost: Cost | None = None  # None when the forward carried prefill
    draft_costs: list[Cost] = []  # one per draft forward
    seconds: float = 0.0  # the executor's whole time for the step (0: not measured)


NOTHING = SeqResult()
