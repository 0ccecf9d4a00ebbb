"""What each request asks for: prompt, output length, shared prefix, planned cancellation.

Request i draws from its own generator seeded by (seed, i), in a fixed order, so
request i is the same whatever the rate, the arrival process or the number of
requests around it: runs and sweep points stay comparable, and a run is
reproducible from --seed alone. With --requests-file, request i is the file's
request for index i (loadgen/request_file.py) and its own max_tokens, where given,
replaces the drawn output length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadgen.lengths import LengthDistribution
from loadgen.prompts import Prompt, PromptSource, SharedPrefixes
from loadgen.request_file import RequestFile
from loadgen.trace import TraceEntry

REQUEST_STREAM = 3  # the seed-sequence branch for request content
SEED_RANGE = 2**31  # per-request sampling seeds, so sampled outputs repeat too


@dataclass(frozen=True)
class RequestSpec:
    index: int
    warmup: bool  # sent like the others, left out of every metric
    offset_s: float | None  # scheduled arrival from run start; None: closed loop
    prompt: Prompt
    max_tokens: int
    seed: int
    prefix_id: int | None = None
    cancel_after_s: float | None = None  # from the moment it is sent
    sampling: Mapping[str, Any] = field(default_factory=dict)  # per-request overrides
    item: str | None = None  # --requests-file: the file and line it came from
    kind: str | None = None  # --requests-file: the entry's `kind`


@dataclass(frozen=True)
class CancelPolicy:
    fraction: float
    max_delay_s: float  # delays are uniform in [0, max_delay_s]


@dataclass(frozen=True)
class Workload:
    source: PromptSource
    prompt_len: LengthDistribution
    output_len: LengthDistribution
    seed: int
    prefixes: SharedPrefixes | None = None
    cancel: CancelPolicy | None = None
    requests: RequestFile | None = None  # real requests replace source and prompt_len

    def request(
        self, index: int, warmup: bool, offset_s: float | None, entry: TraceEntry | None = None
    ) -> RequestSpec:
        rng = np.random.default_rng([self.seed, REQUEST_STREAM, index])
        # Fixed-count draws first, the variable-length prompt body last.
        prompt_len = self.prompt_len.sample(rng)
        output_len = self.output_len.sample(rng)
        prefix_id = self.prefixes.pick(rng) if self.prefixes else None
        cancel_after_s = self._cancel_delay(rng)
        seed = int(rng.integers(0, SEED_RANGE))
        if entry is not None:
            return self._from_entry(entry, rng, (index, warmup, offset_s), (seed, cancel_after_s))
        if self.requests is not None:
            real = self.requests.pick(self.seed, index)
            return RequestSpec(
                index, warmup, offset_s, real.prompt, real.max_tokens or output_len, seed,
                cancel_after_s=cancel_after_s, item=real.where, kind=real.kind,
            )
        prompt = self.source.make(rng, prompt_len)
        if self.prefixes is not None and prefix_id is not None:
            prompt = self.source.join(self.prefixes.prefixes[prefix_id], prompt)
        return RequestSpec(
            index, warmup, offset_s, prompt, output_len, seed, prefix_id, cancel_after_s
        )

    def mean_output_len(self) -> float:
        """The nominal mean max_tokens, with a request file's own lengths where it gives them."""
        if self.requests is None:
            return self.output_len.mean
        lengths = [r.max_tokens or self.output_len.mean for r in self.requests.requests]
        return sum(lengths) / len(lengths)

    def _cancel_delay(self, rng: np.random.Generator) -> float | None:
        if self.cancel is None:
            return None
        chosen, delay = rng.random(), float(rng.uniform(0.0, self.cancel.max_delay_s))
        return delay if chosen < self.cancel.fraction else None

    def _from_entry(
        self,
        entry: TraceEntry,
        rng: np.random.Generator,
        where: tuple[int, bool, float | None],
        drawn: tuple[int, float | None],
    ) -> RequestSpec:
        index, warmup, offset_s = where
        seed, cancel_after_s = drawn
        prompt: Prompt
        if entry.prompt_text is not None:
            prompt = entry.prompt_text
        elif entry.prompt_token_ids is not None:
            prompt = entry.prompt_token_ids
        else:
            assert entry.prompt_len is not None
            prompt = self.source.make(rng, entry.prompt_len)
        return RequestSpec(
            index, warmup, offset_s, prompt, entry.output_len, seed,
            cancel_after_s=cancel_after_s, sampling=entry.sampling,
        )
