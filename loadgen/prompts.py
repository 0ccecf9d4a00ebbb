"""Prompt material: random token ids within a vocabulary, or windows of words from a text file.

Token-id prompts are how tiny test models are driven (they go in the request's
`token_ids`); text prompts go in `text`, and their lengths are counted in words
(the server's usage reports the real token counts). A Conversation is a chat
request read from --requests-file (loadgen/request_file.py), sent as its messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from loadgen.errors import UsageError


@dataclass(frozen=True)
class Conversation:
    """Chat messages as (role, content), the last one the user's."""

    messages: tuple[tuple[str, str], ...]

    def words(self) -> int:
        """The prompt's length as loadgen counts text: words, over every message."""
        return sum(len(content.split()) for _, content in self.messages)

    def lone_user_text(self) -> str | None:
        """The text of a conversation that is one user message, else None."""
        if len(self.messages) == 1 and self.messages[0][0] == "user":
            return self.messages[0][1]
        return None

    def to_openai(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


Prompt = tuple[int, ...] | str | Conversation


class PromptSource(Protocol):
    def make(self, rng: np.random.Generator, length: int) -> Prompt: ...

    def join(self, prefix: Prompt, body: Prompt) -> Prompt: ...


@dataclass(frozen=True)
class TokenPrompts:
    vocab_size: int

    def make(self, rng: np.random.Generator, length: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(0, self.vocab_size, length))

    def join(self, prefix: Prompt, body: Prompt) -> Prompt:
        assert isinstance(prefix, tuple) and isinstance(body, tuple)
        return prefix + body


@dataclass(frozen=True)
class TextPrompts:
    words: tuple[str, ...]

    def make(self, rng: np.random.Generator, length: int) -> str:
        # A window that wraps around, so any length works with any file.
        start = int(rng.integers(0, len(self.words)))
        picked = [self.words[(start + i) % len(self.words)] for i in range(length)]
        return " ".join(picked)

    def join(self, prefix: Prompt, body: Prompt) -> Prompt:
        assert isinstance(prefix, str) and isinstance(body, str)
        return f"{prefix} {body}"


def read_text_prompts(path: str) -> TextPrompts:
    try:
        words = tuple(Path(path).read_text(encoding="utf-8").split())
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--prompts-file: cannot read {path}: {error}") from None
    if not words:
        raise UsageError(f"--prompts-file: {path} holds no words")
    return TextPrompts(words)


PREFIX_STREAM = 2  # the seed-sequence branch for the shared prefixes


@dataclass(frozen=True)
class SharedPrefixes:
    """A few common prefixes; a fraction of requests start with one of them.

    Requests that share a prefix can reuse its committed KV blocks from the
    server's prefix cache, so this exercises (and measures) that cache.
    """

    fraction: float
    prefixes: tuple[Prompt, ...]

    @classmethod
    def build(
        cls, source: PromptSource, seed: int, shape: tuple[float, int, int]
    ) -> SharedPrefixes:
        """shape = (fraction, number of prefixes, prefix length)."""
        fraction, count, length = shape
        rng = np.random.default_rng([seed, PREFIX_STREAM])
        return cls(fraction, tuple(source.make(rng, length) for _ in range(count)))

    def pick(self, rng: np.random.Generator) -> int | None:
        """Which prefix a request gets, or None; always draws twice so streams stay aligned."""
        use, which = rng.random(), int(rng.integers(0, len(self.prefixes)))
        return which if use < self.fraction else None
