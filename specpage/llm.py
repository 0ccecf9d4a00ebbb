"""In-process use of the engine: batch generation and streaming, no daemon.

`LLM.generate` returns the same `Completion` as the gRPC `Client.complete`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from specpage.completion import Completion, Durations
from specpage.core.request import SamplingParams, ValidationError
from specpage.engine import Engine, EngineConfig, RequestOutput
from specpage.models.config import ModelLoadError
from specpage.models.fetch import ensure_model, known_models
from specpage.models.loader import LoadedModel, draft_dtype, load_model
from specpage.models.quant_names import check_tensor_parallel


def resolve_model(name_or_path: str | Path) -> Path:
    """A known model name (fetched into the cache once) or a path."""
    if str(name_or_path) in known_models():
        return ensure_model(str(name_or_path))
    path = Path(name_or_path)
    if not path.exists():
        raise ModelLoadError(f"{name_or_path}: no such file or folder, and not a known model "
                             f"name (known: {', '.join(known_models())})")
    return path


def load_tokenizer(folder: Path) -> Any:
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """The model's chat template around one user message."""
    return conversation_prompt(tokenizer, [text])


def conversation_prompt(tokenizer: Any, turns: Sequence[str]) -> list[int]:
    """The model's chat template around alternating user and assistant
    turns (the user's first), ready for the assistant's next."""
    messages = [{"role": "user" if n % 2 == 0 else "assistant", "content": text}
                for n, text in enumerate(turns)]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            return_dict=True)
    return list(encoded["input_ids"])


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
        target_path = resolve_model(model)
        self.target: LoadedModel = load_model(target_path, dtype, device, quantization)
        check_tensor_parallel(self.target.quantization,
                              (config or EngineConfig()).tensor_parallel_size)
        self.draft = (load_model(resolve_model(draft), draft_dtype(dtype, self.target), device,
                                 quantization) if draft else None)
        self.tokenizer = load_tokenizer(self.target.folder)
        self.engine = Engine(self.target, self.draft, self.tokenizer, config)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> list[Completion]:
        """Run every prompt to completion, batched continuously; in order.

        chat: wrap a text prompt in the model's chat template, as one user
        message (a ValidationError if the model has none); False sends
        the text as it is. Token-id prompts are never wrapped."""
        params = params or SamplingParams()
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        completions = []
        for prompt, p in zip(prompts, all_params, strict=True):
            completion = Completion(f"llm-{next(self._ids)}")
            completion.sample(p.n - 1)  # all n samples, by index
            self.engine.add_request(completion.request_id, self._prompt(prompt, chat), p)
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
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValidationError("chat", "the model has no chat template")
        return chat_prompt(self.tokenizer, prompt)

    @staticmethod
    def _record(completion: Completion, out: RequestOutput) -> None:
        completion.add(out.index, out.token_ids, out.text, out.logprobs or [],
                       out.finish_reason if out.finished else None)
        if out.usage is not None and out.timings is not None:
            completion.usage, completion.timings = out.usage, Durations.of(out.timings)
