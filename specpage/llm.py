"""In-process use of the engine: batch generation and streaming, no daemon.

`LLM.generate` returns the same `Completion` as the gRPC `Client.complete`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from specpage.completion import Completion, Durations
from specpage.core.chat_template import alternating_turns, chat_token_ids
from specpage.core.grammar import Constraint
from specpage.core.request import SamplingParams
from specpage.engine import EngineConfig, RequestOutput
from specpage.engine.builder import ModelChoice, build_engine
from specpage.models.loader import LoadedModel


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """The model's chat template around one user message."""
    return conversation_prompt(tokenizer, [text])


def conversation_prompt(tokenizer: Any, turns: Sequence[str]) -> list[int]:
    """The model's chat template around alternating user and assistant
    turns (the user's first), ready for the assistant's next."""
    return chat_token_ids(tokenizer, alternating_turns(turns))


class LLM:
    def __init__(
        self,
        model: str | Path,
        draft: str | Path | None = None,
        config: EngineConfig | None = None,
        dtype: str | None = None,
        device: str = "cpu",
        quantization: str | None = None,
    ) -> None:
        """quantization: of both models' linears (models/quant_names:
        none, q4, q4-g64, q4-g128, auto); None: none, the exact path."""
        self.engine, models = build_engine(
            ModelChoice(model, draft, dtype, device, quantization), config)
        self.target: LoadedModel = models.target
        self.draft = models.draft
        self.tokenizer = models.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        constraint: Constraint | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion, batched continuously; in order.

        chat: wrap a text prompt in the model's chat template, as one user
        message (a ValidationError if the model has none); False sends
        the text as it is. Token-id prompts are never wrapped.
        constraint: what every output must match (core/grammar.py)."""
        params = params or SamplingParams()
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        completions = []
        for prompt, p in zip(prompts, all_params, strict=True):
            completion = Completion(f"llm-{next(self._ids)}")
            completion.sample(p.n - 1)  # all n samples, by index
            self.engine.add_request(completion.request_id, self._prompt(prompt, chat), p,
                                    constraint=constraint)
            completions.append(completion)
        by_id = {completion.request_id: completion for completion in completions}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                self._record(by_id[out.request_id], out)
        return completions

    def stream(self, prompt: str | Sequence[int], params: SamplingParams, *,
               chat: bool = False) -> Iterator[str]:
        """Text deltas of one request (sample 0) as they are produced.

        chat: as for `generate`."""
        request_id = f"llm-{next(self._ids)}"
        self.engine.add_request(request_id, self._prompt(prompt, chat), params)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id == request_id and out.index == 0 and out.text:
                    yield out.text

    def _prompt(self, prompt: str | Sequence[int], chat: bool) -> str | Sequence[int]:
        if not chat or not isinstance(prompt, str):
            return prompt
        return chat_token_ids(self.tokenizer, alternating_turns([prompt]), "chat")

    @staticmethod
    def _record(completion: Completion, out: RequestOutput) -> None:
        completion.add(out.index, out.token_ids, out.text, out.logprobs or [],
                       out.finish_reason if out.finished else None)
        if out.usage is not None and out.timings is not None:
            completion.usage, completion.timings = out.usage, Durations.of(out.timings)
