"""Output processing: sampled tokens into what a request's caller sees.

Stop rules (EOS, stop token ids, max_tokens, the context, stop strings),
incremental detokenizing, usage and timings. It decides how many of a
step's tokens a sample keeps and hands them to the ledger; ending a
sequence goes back to the core through `end`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import msgspec

from specpage.core import ledger
from specpage.core.detokenizer import IncrementalDetokenizer
from specpage.core.request import (
    FinishReason,
    Request,
    Sequence,
    Timings,
    TokenLogprobs,
    Usage,
)

Top = list[tuple[int, float]]  # (token id, log-probability), likeliest first


class RequestOutput(msgspec.Struct):
    """What one step produced for one sample of a request."""

    request_id: str
    index: int  # sample, 0..n-1
    token_ids: list[int]  # new this step
    text: str  # new text this step
    num_tokens: int  # completion tokens of this sample so far
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[Top] | None = None  # per token, with params.top_logprobs
    # the prompt's, position by position (None at 0), with the sample's first
    # output when params.prompt_logprobs asks for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    usage: Usage | None = None  # on the last output of the request
    timings: Timings | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: Seq[int], max_context: int,
                 end: Callable[[Sequence, FinishReason], None]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_context = max_context
        self.end = end  # ends a sequence in the scheduler and frees its blocks

    def detokenizer(self, request: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                      request.params.stop, request.params.min_tokens)

    def append(self, seq: Sequence, tokens: Seq[int], logprobs: Seq[float],
               top: Seq[Top] = ()) -> RequestOutput:
        """Add sampled tokens to a sequence, cut at its first stop condition;
        top: the likeliest tokens at each one's position, when asked for."""
        params = seq.request.params
        first = not seq.num_output
        kept: list[int] = []
        reason = None
        eos = () if params.ignore_eos else self.eos_token_ids
        # the sampler bans EOS and stop ids below min_tokens; were one there, it ends nothing
        done = seq.num_output
        end_token = False  # the last kept token is EOS or a stop id, not text
        for token in tokens:
            kept.append(token)
            if ((token in eos or token in params.stop_token_ids)
                    and done + len(kept) > params.min_tokens):
                reason, end_token = FinishReason.STOP, True
            elif (done + len(kept) >= params.max_tokens
                  or seq.num_tokens + len(kept) >= self.max_context):
                reason = FinishReason.LENGTH
            if seq.grammar is not None and not end_token:
                reason = _grammar_reason(seq, token) or reason
            if reason:
                break
        text = ""
        detok: IncrementalDetokenizer | None = seq.detok  # type: ignore[assignment]
        if detok is not None:
            text_ids = kept[:-1] if end_token else kept
            text = detok.add(text_ids)
            if detok.stopped:
                # A stop string ends the output at the token that completes it,
                # even when more tokens were accepted in the same step (and
                # before a length limit reached with that same token).
                del kept[detok.used :]
                reason = FinishReason.STOP
        kept_logprobs = list(logprobs[: len(kept)])
        ledger.append_output(seq, kept, kept_logprobs)
        request = seq.request
        if request.timings.first_token is None:
            request.timings.first_token = time.monotonic()
        if reason:
            out = self.finish(seq, reason, kept, text, kept_logprobs)
        else:
            out = RequestOutput(request.request_id, seq.index, kept, text,
                                seq.num_output,
                                logprobs=kept_logprobs if params.logprobs else None)
        if params.logprobs and params.top_logprobs:
            out.top_logprobs = list(top[: len(kept)])
        if first and params.prompt_logprobs is not None:
            out.prompt_logprobs = request.prompt_logprobs
        return out

    def finish(
        self, seq: Sequence, reason: FinishReason, tokens: list[int], text: str,
        logprobs: list[float] | None = None,
    ) -> RequestOutput:
        """End a sample; the request's last one carries its usage and timings."""
        self.end(seq, reason)
        detok: IncrementalDetokenizer | None = seq.detok  # type: ignore[assignment]
        if detok is not None and not detok.stopped:
            text += detok.flush()  # held back for a stop string that never came
        request = seq.request
        request.usage.completion_tokens = sum(s.num_output for s in request.sequences)
        output = RequestOutput(
            request.request_id, seq.index, tokens, text, seq.num_output,
            finished=True, finish_reason=str(reason),
            logprobs=logprobs if request.params.logprobs else None,
        )
        request.num_ended += 1
        if request.num_ended == len(request.sequences):  # the request's last output
            request.timings.finished = time.monotonic()
            output.usage, output.timings = request.usage, request.timings
        return output

    @staticmethod
    def unforked(request: Request, reason: FinishReason) -> list[RequestOutput]:
        """Samples 1..n-1 fork at sample 0's first token; a request that ends
        before it (aborted, past its deadline, failed) ends them too, each
        with an output of its own, before the request's last output."""
        return [RequestOutput(request.request_id, index, [], "", 0, finished=True,
                              finish_reason=str(reason))
                for index in range(len(request.sequences), request.params.n)]


def _grammar_reason(seq: Sequence, token: int) -> FinishReason | None:
    """Whether a constrained sequence ends at this token, which its grammar
    takes: the grammar complete (it would admit only EOS next: the output
    is done, as a stop string ends one, and tokens after it in the step are
    dropped), or, were the token outside the grammar (the masks make that
    impossible), in error."""
    if seq.grammar.take(token) is not None:
        return FinishReason.ERROR
    return FinishReason.STOP if seq.grammar.stopped else None
