"""Incremental detokenization: text deltas that never split a UTF-8
character and hold back text that may be the start of a stop string.

A step decodes only the tokens since the last point where the text was
whole (no character left waiting for its bytes), after the tokens of the
step before, as vLLM's incremental detokenizer does: the new text is what
that window decodes to beyond what its first part decoded to. Decoding the
whole output every step costs in proportion to its length: at batch 64
and 1,024 tokens each, 13.2 ms a step (5.5%) against 1.4 ms this way
(docs/BENCHMARKS.md, "overhead").

Stop strings are matched by an automaton fed only each step's new text
(stop_matcher.py), so a step costs the same with one stop string or many.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specpage.core.stop_matcher import StopMatcher, automaton_for

PROMPT_CONTEXT = 4  # prompt tokens decoded before the output, for spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str],
                 min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        # a stop string completed by an output token before this one ends nothing
        self.min_tokens = min_tokens
        self.context = list(prompt_ids[-PROMPT_CONTEXT:])
        # A prompt that ends inside a character decodes to a trailing U+FFFD
        # that the first output bytes may complete: compare without it.
        context_text = self._decode(self.context)
        self.context_text = context_text.rstrip("\ufffd")
        # The window decoded each step: tokens (of context + output) from
        # `start`; those before `read` decoded to `read_text`, which ends
        # `whole` (the text up to `read`, output only). `read` is where the
        # text was whole, but for the prompt's end, which may split a
        # character (`read_whole` False): a window never starts there.
        self.start, self.read = 0, len(self.context)
        self.read_text, self.whole = self.context_text, ""
        self.read_whole = self.context_text == context_text
        self._window = (0, self.context_text)  # (output tokens, their window's text)
        self.matcher = StopMatcher(automaton_for(tuple(stop))) if stop else None
        self.output_ids: list[int] = []
        self.text = ""  # all output text so far (cut at a stop string)
        self.emitted = 0  # characters of text already released
        self.stopped = False
        self.used = 0  # tokens of the last add() that are output (see add)

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new output tokens; return the text now safe to release. When a
        stop string completes, `used` is how many of these tokens it took: the
        output ends with the token that completes it, as it would one token
        per step."""
        self.used = 0
        if self.stopped:
            return ""
        matcher, early = self.matcher, 0
        if matcher is not None:
            early = max(0, min(len(token_ids), self.min_tokens - 1 - len(self.output_ids)))
        if matcher is not None and early:
            # below min_tokens: match past them, as if no stop string ended there
            self.output_ids.extend(token_ids[:early])
            self.text = self._complete_text()
            self._move_window()
            matcher.move(matcher.scan(self.text))
            token_ids = token_ids[early:]
        released = self._add(token_ids)
        self.used += early
        return released

    def _add(self, token_ids: Sequence[int]) -> str:
        base = len(self.output_ids)
        self.output_ids.extend(token_ids)
        self.used = len(token_ids)
        complete = self._complete_text()
        self.text = complete
        if self.matcher is None:
            self._move_window()
            return self._release(len(complete))
        scan = self.matcher.scan(complete)
        if scan.hit is None:
            self._move_window()
            self.matcher.move(scan)
            # no stop string ends the text, so the held tail is a proper prefix of one
            return self._release(len(complete) - self.matcher.held)
        for n in range(1, len(token_ids) + 1):  # the first token that completes one
            self.output_ids[base:] = token_ids[:n]
            complete = self._complete_text()
            hit = self.matcher.scan(complete).hit
            if hit is not None:
                break
        self.used = n
        self.text = complete[:hit]
        self.stopped = True
        return self._release(len(self.text))

    def _tokens(self, start: int) -> list[int]:
        """Context + output tokens from start on."""
        skip = start - len(self.context)
        if skip >= 0:
            return self.output_ids[skip:]
        return self.context[start:] + self.output_ids

    def _complete_text(self) -> str:
        """The output's text, a trailing partial character left to wait for its bytes."""
        window = self._decode(self._tokens(self.start))
        self._window = (len(self.output_ids), window)
        return self.whole + window[len(self.read_text):].rstrip("\ufffd")

    def _move_window(self) -> None:
        """After the text of every output token so far is decided: where it
        is whole, the next window starts at the tokens this one read."""
        count, window = self._window
        assert count == len(self.output_ids)
        new = window[len(self.read_text):]
        if not new or new.endswith("\ufffd"):
            return
        self.whole += new
        if self.read_whole:
            self.start, window = self.read, self._decode(self._tokens(self.read))
        self.read, self.read_text, self.read_whole = (
            len(self.context) + len(self.output_ids), window, True)

    def flush(self) -> str:
        """At the end: release whatever was held back for a stop string."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

