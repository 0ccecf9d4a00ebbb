"""Engine events -> OpenAI's response objects: `chat.completion` and its
`chat.completion.chunk` stream, `text_completion` (streamed in the same shape),
and `usage` with the prefix-cache and speculation counts."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specpage.core.request import Usage
from specpage.engine.async_engine import Chunk

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


@dataclass
class Sample:
    """One choice's output so far (a non-streamed response collects them)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
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
            choice: Json = {"index": index, "finish_reason": sample.finish_reason,
                            "logprobs": self._logprobs(sample.token_ids, sample.logprobs)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": sample.text}
            else:
                choice["text"] = sample.text
            choices.append(choice)
        return self._object("chat.completion" if self.chat else "text_completion",
                            choices, counts)

    def chunk(self, chunk: Chunk, index: int, opens: bool = False) -> Json:
        """index: the choice's (prompt i's sample j is i x n + j, as OpenAI
        numbers a batch). opens: the choice's first chunk, which in a chat
        stream carries the assistant's role with the first text ("" while
        its tokens have none yet), as vLLM's does. It goes with the first
        token, never before it: a client that times its first chunk times
        the first token."""
        choice: Json = {"index": index, "finish_reason": chunk.finish_reason,
                        "logprobs": self._logprobs(chunk.token_ids, chunk.logprobs)}
        if self.chat:
            choice["delta"] = _delta(chunk.text, opens)
        else:
            choice["text"] = chunk.text
        return self._chunk(choice)

    def usage_chunk(self, counts: Usage) -> Json:
        """stream_options.include_usage: a last chunk with no choices."""
        return self._object(self._chunk_kind, [], counts)

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: Json) -> Json:
        return self._object(self._chunk_kind, [choice], None)

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> Json | None:
        if not self.logprobs:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        if self.chat:
            return {"content": [
                {"token": text, "logprob": logprob, "bytes": list(text.encode()),
                 "top_logprobs": []}
                for text, logprob in zip(tokens, logprobs, strict=True)]}
        return {"tokens": tokens, "token_logprobs": logprobs,
                "top_logprobs": None, "text_offset": None}


def _delta(text: str, opens: bool) -> Json:
    if opens:
        return {"role": "assistant", "content": text}
    return {"content": text} if text else {}
