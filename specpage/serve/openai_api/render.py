"""Engine events -> OpenAI's response objects: `chat.completion` and its
`chat.completion.chunk` stream, `text_completion` (streamed in the same shape),
and `usage` with the prefix-cache and speculation counts."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specpage.core.outputs import Top
from specpage.core.request import TokenLogprobs, Usage
from specpage.engine.async_engine import Chunk
from specpage.serve.openai_api.tools import ToolStream, parse

Json = dict[str, Any]


def usage(counts: Usage) -> Json:
    return {
        "prompt_tokens": counts.prompt_tokens,
        "completion_tokens": counts.completion_tokens,
        "total_tokens": counts.prompt_tokens + counts.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": counts.cached_tokens},
        # An extension: what speculation drafted and the target kept, all samples together.
        "speculation": {"drafted_tokens": counts.drafted_tokens,
                        "accepted_tokens": counts.accepted_tokens,
                        "by_method": {method: {"drafted_tokens": drafted,
                                               "accepted_tokens": accepted}
                                      for method, (drafted, accepted)
                                      in counts.by_method.items()}},
    }


def total(counts: list[Usage]) -> Usage:
    """The usage of a batch's requests together."""
    by_method: dict[str, list[int]] = {}
    for one in counts:
        for method, (drafted, accepted) in one.by_method.items():
            summed = by_method.setdefault(method, [0, 0])
            summed[0] += drafted
            summed[1] += accepted
    return Usage(
        prompt_tokens=sum(c.prompt_tokens for c in counts),
        completion_tokens=sum(c.completion_tokens for c in counts),
        cached_tokens=sum(c.cached_tokens for c in counts),
        drafted_tokens=sum(c.drafted_tokens for c in counts),
        accepted_tokens=sum(c.accepted_tokens for c in counts),
        by_method=by_method)


@dataclass(frozen=True)
class ChoicePrompt:
    """A choice's prompt, for echo and the prompt's log-probabilities."""

    token_ids: tuple[int, ...]  # as the engine ran it
    text: str  # as echo writes it: the text given, or the token ids decoded


@dataclass
class Sample:
    """One choice's output so far (a non-streamed response collects them)."""

    prompt: ChoicePrompt = ChoicePrompt((), "")
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Top] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.top_logprobs += chunk.top_logprobs
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.finish_reason = chunk.finish_reason or self.finish_reason


@dataclass(frozen=True)
class Renderer:
    """Objects for one request: chat or completion, with its id and model name."""

    chat: bool
    request_id: str
    model: str
    logprobs: bool
    token_text: Callable[[int], str]  # a token's own text, for log-probabilities
    created: int = field(default_factory=lambda: int(time.time()))
    top_logprobs: int = 0  # alternatives shown per token (chat's top_logprobs, legacy logprobs)
    echo: bool = False  # a completion's text (and log-probabilities) start with the prompt's
    echo_only: bool = False  # max_tokens 0 with echo: the prompt alone, nothing generated
    prompt_logprobs: int | None = None  # vLLM's: alternatives per prompt position
    tools: bool = False  # a chat's tool calls are parsed out of its text (tools.py)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.request_id}"

    def _object(self, kind: str, choices: list[Json], counts: Usage | None) -> Json:
        body: Json = {"id": self.id, "object": kind, "created": self.created,
                      "model": self.model, "choices": choices}
        if counts is not None:
            body["usage"] = usage(counts)
        return body

    def response(self, samples: list[Sample], counts: Usage) -> Json:
        choices = []
        for index, sample in enumerate(samples):
            if self.echo_only:
                sample = Sample(sample.prompt, prompt_logprobs=sample.prompt_logprobs,
                                finish_reason=sample.finish_reason)
            choice: Json = {"index": index, "finish_reason": sample.finish_reason,
                            "logprobs": self._logprobs(sample, opens=True)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": sample.text}
                if self.tools:
                    content, calls = parse(sample.text)
                    if calls:
                        choice["message"] = {"role": "assistant", "content": content,
                                             "tool_calls": calls}
                        choice["finish_reason"] = _with_calls(sample.finish_reason)
            else:
                choice["text"] = (sample.prompt.text if self.echo else "") + sample.text
                self._add_prompt_logprobs(choice, sample)
            choices.append(choice)
        body = self._object("chat.completion" if self.chat else "text_completion",
                            choices, counts)
        if self.chat and samples:
            self._add_prompt_logprobs(body, samples[0])  # vLLM's place for chat
        return body

    def chunk(self, chunk: Chunk, index: int, opens: bool = False,
              prompt: ChoicePrompt = ChoicePrompt((), ""),
              tool_stream: ToolStream | None = None) -> Json:
        """index: the choice's (prompt i's sample j is i x n + j, as OpenAI
        numbers a batch). opens: the choice's first chunk, which in a chat
        stream carries the assistant's role with the first text ("" while
        its tokens have none yet), as vLLM's does. It goes with the first
        token, never before it: a client that times its first chunk times
        the first token."""
        sample = Sample(prompt, finish_reason=chunk.finish_reason)
        if not self.echo_only:
            sample.add(chunk)
        sample.prompt_logprobs = chunk.prompt_logprobs
        choice: Json = {"index": index, "finish_reason": chunk.finish_reason,
                        "logprobs": self._logprobs(sample, opens)}
        if self.chat and tool_stream is not None:
            called = tool_stream.num_calls
            text, calls = tool_stream.feed(sample.text)
            if chunk.finish_reason:
                text += tool_stream.finish()
                if tool_stream.num_calls:
                    choice["finish_reason"] = _with_calls(chunk.finish_reason)
            choice["delta"] = _delta(text, opens)
            if calls:
                choice["delta"]["tool_calls"] = [{"index": called + i, **call}
                                                 for i, call in enumerate(calls)]
        elif self.chat:
            choice["delta"] = _delta(sample.text, opens)
        else:
            choice["text"] = (prompt.text if self.echo and opens else "") + sample.text
            if opens:
                self._add_prompt_logprobs(choice, sample)
        body = self._chunk(choice)
        if self.chat and opens:
            self._add_prompt_logprobs(body, sample)
        return body

    def usage_chunk(self, counts: Usage) -> Json:
        """stream_options.include_usage: a last chunk with no choices."""
        return self._object(self._chunk_kind, [], counts)

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: Json) -> Json:
        return self._object(self._chunk_kind, [choice], None)

    def _logprobs(self, sample: Sample, opens: bool) -> Json | None:
        """OpenAI's logprobs of a choice (or of a chunk of it): chat's
        `content`, or the legacy completion's parallel lists, which with echo
        start with the prompt's tokens (the first one's log-probability null)."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [
                {**self._entry(token, logprob),
                 "top_logprobs": [self._entry(t, lp) for t, lp in top[: self.top_logprobs]]}
                for token, logprob, top in zip(sample.token_ids, sample.logprobs,
                                               self._tops(sample), strict=True)]}
        token_ids: list[int] = list(sample.token_ids)
        logprobs: list[float | None] = list(sample.logprobs)
        tops: list[Json | None] = [self._legacy_top(t, lp, top) for t, lp, top in zip(
            sample.token_ids, sample.logprobs, self._tops(sample), strict=True)]
        if self.echo and opens:
            token_ids = list(sample.prompt.token_ids) + token_ids
            found = sample.prompt_logprobs or [None] * len(sample.prompt.token_ids)
            logprobs = [None if p is None else p.logprob for p in found] + logprobs
            tops = [None if p is None else self._legacy_top(t, p.logprob, p.top)
                    for t, p in zip(sample.prompt.token_ids, found, strict=True)] + tops
        tokens = [self.token_text(t) for t in token_ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
        return {"tokens": tokens, "token_logprobs": logprobs,
                "top_logprobs": tops if self.top_logprobs else None,
                "text_offset": offsets if tokens else []}

    def _tops(self, sample: Sample) -> list[Top]:
        return sample.top_logprobs or [[] for _ in sample.token_ids]

    def _entry(self, token: int, logprob: float) -> Json:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _legacy_top(self, token: int, logprob: float, top: Top) -> Json:
        """The legacy shape: token text -> log-probability, the likeliest
        `logprobs` of them and the chosen one, as vLLM's."""
        alternatives = {self.token_text(t): lp for t, lp in top[: self.top_logprobs]}
        return {**alternatives, self.token_text(token): logprob}

    def _add_prompt_logprobs(self, body: Json, sample: Sample) -> None:
        """vLLM's prompt_logprobs: per prompt position, token id -> {logprob,
        rank, decoded_token} for the prompt's token and the likeliest, None first."""
        if self.prompt_logprobs is None:
            return
        found = sample.prompt_logprobs or [None] * len(sample.prompt.token_ids)
        body["prompt_logprobs"] = [
            None if p is None else {
                str(t): {"logprob": lp, "rank": rank, "decoded_token": self.token_text(t)}
                for t, lp, rank in [*((t, lp, r) for r, (t, lp) in enumerate(
                    p.top[: self.prompt_logprobs], start=1)), (token, p.logprob, p.rank)]}
            for token, p in zip(sample.prompt.token_ids, found, strict=True)]


def _with_calls(finish_reason: str | None) -> str | None:
    """OpenAI's finish reason for a choice that ended by calling tools."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _delta(text: str, opens: bool) -> Json:
    if opens:
        return {"role": "assistant", "content": text}
    return {"content": text} if text else {}
