"""Requests in: validating parameters and prompts, and tokenizing.

Touches no engine state, so any thread may run it (the daemon runs it on
its own pool, off the event loop and off the step).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any

from specpage.core.arith import cdiv
from specpage.core.engine_config import EngineConfig
from specpage.core.grammar import Constraint, Grammars
from specpage.core.request import Request, SamplingParams, ValidationError, validate_prompt


class Intake:
    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int,
                 max_context: int, k_max: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        # structured outputs: constraints compiled over the tokenizer (core/grammar.py)
        self.grammars = Grammars(tokenizer, vocab_size, eos_token_ids)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.k_max = k_max

    def make_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
        *,
        prompt_field: str = "prompt",
        arrival: float | None = None,
        constraint: Constraint | None = None,
    ) -> Request:
        """Validate, tokenize and compile the constraint, if any.

        prompt_field names the prompt in errors (a front end's own field);
        arrival (time.monotonic()) is when the caller received the request,
        now if None, so queue and end-to-end times include tokenizing."""
        config = self.config
        params.validate(config.stop_limits)
        if params.n > config.max_num_seqs:
            raise ValidationError("n", f"{params.n} samples exceed max_num_seqs "
                                  f"({config.max_num_seqs})")
        params.validate_vocabulary(self.vocab_size)
        prompt_ids = self._tokenize(prompt, prompt_field)
        validate_prompt(prompt_ids, self.vocab_size, self.max_context, prompt_field)
        self._check_fits(len(prompt_ids), params)
        if params.stop and self.tokenizer is None:
            raise ValidationError("stop", "stop strings need a tokenizer")
        request = Request(request_id, tuple(prompt_ids), params, priority, deadline,
                          arrival=time.monotonic() if arrival is None else arrival)
        if constraint is not None:
            request.grammar = self.grammars.compile(constraint)
        return request

    def _tokenize(self, prompt: str | Seq[int], prompt_field: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValidationError(prompt_field,
                                      "text prompts need a tokenizer; send token ids")
            # with the tokenizer's own special tokens (a BOS, where the model
            # wants one: Gemma's text is garbage without it), as vLLM's
            # completions and llama.cpp's server tokenize a prompt
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Refuse a request whose samples the pool could never hold at once.
        Its output ends at max_tokens or the context's end, whichever comes
        first (speculation proposes nothing past either), so a max_tokens
        past the context asks for no more blocks than the context holds."""
        positions = min(prompt_len + params.max_tokens + self.k_max + 1, self.max_context)
        blocks = cdiv(positions, self.config.block_size) * params.n
        if blocks > self.config.num_blocks:
            raise ValidationError(
                "max_tokens",
                f"prompt ({prompt_len}) + max_tokens ({params.max_tokens}), up to the context "
                f"({self.max_context}), need {blocks} KV blocks for {params.n} sample(s); "
                f"the pool has {self.config.num_blocks}",
            )
