"""In-process use of the engine: batch generation and streaming, no daemon."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpage.engine import Engine, EngineConfig, RequestOutput
from specpage.models.fetch import ensure_model, known_models
from specpage.models.loader import LoadedModel, load_model
from specpage.request import SamplingParams, Usage


@dataclass
class SampleOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Completion:
    request_id: str
    samples: list[SampleOutput]
    usage: Usage | None = None


def resolve_model(name_or_path: str | Path) -> Path:
    """A known model name (fetched into the cache once) or a path."""
    if str(name_or_path) in known_models():
        return ensure_model(str(name_or_path))
    return Path(name_or_path)


def load_tokenizer(folder: Path) -> Any:
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """The model's chat template around one user message."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
    )
    return list(encoded["input_ids"])


class LLM:
    def __init__(
        self,
        model: str | Path,
        draft: str | Path | None = None,
        config: EngineConfig | None = None,
        dtype: str | None = None,
        device: str = "cpu",
    ) -> None:
        target_path = resolve_model(model)
        self.target: LoadedModel = load_model(target_path, dtype, device)
        self.draft = load_model(resolve_model(draft), dtype, device) if draft else None
        self.tokenizer = load_tokenizer(self.target.folder)
        self.engine = Engine(self.target, self.draft, self.tokenizer, config)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion, batched continuously; in order."""
        params = params or SamplingParams()
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        ids = []
        for prompt, p in zip(prompts, all_params, strict=True):
            request_id = f"llm-{next(self._ids)}"
            self.engine.add_request(request_id, prompt, p)
            ids.append(request_id)
        completions = {
            i: Completion(i, [SampleOutput(s) for s in range(p.n)])
            for i, p in zip(ids, all_params, strict=True)
        }
        while self.engine.has_unfinished():
            for out in self.engine.step():
                self._record(completions[out.request_id], out)
        return [completions[i] for i in ids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams) -> Iterator[str]:
        """Text deltas of one request as they are produced."""
        request_id = f"llm-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, params)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id == request_id and out.text:
                    yield out.text

    @staticmethod
    def _record(completion: Completion, out: RequestOutput) -> None:
        sample = completion.samples[out.index]
        sample.token_ids += out.token_ids
        sample.text += out.text
        sample.logprobs += out.logprobs or []
        if out.finished:
            sample.finish_reason = out.finish_reason
        if out.usage is not None:
            completion.usage = out.usage
