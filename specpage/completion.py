"""What a finished request produced: one shape for every interface.

``LLM.generate`` (in-process) and ``Client.complete`` (over gRPC) both return a
`Completion`; the client's `Final` event carries the same `Usage` and
`Durations`. Imports neither grpc nor torch, so either side can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specpage.core.request import Timings, TokenLogprobs, Usage


@dataclass(frozen=True)
class Durations:
    """Where a request's time went, in seconds."""

    queue_s: float  # arrival to first scheduled
    prefill_s: float  # first scheduled to first token
    total_s: float  # arrival to finished

    @classmethod
    def of(cls, timings: Timings) -> Durations:
        """From the engine's monotonic stamps; a stage never reached lasts 0."""
        first_scheduled = timings.first_scheduled or timings.arrival
        first_token = timings.first_token or first_scheduled
        finished = timings.finished or first_token
        return cls(queue_s=first_scheduled - timings.arrival,
                   prefill_s=first_token - first_scheduled,
                   total_s=finished - timings.arrival)


@dataclass
class Sample:
    """One of a request's n samples."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)  # when asked for
    finish_reason: str | None = None  # stop, length, abort, timeout, error
    # with top_logprobs: per token, the likeliest (token id, log-probability) there
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # with prompt_logprobs: position by position, None at 0 (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class Completion:
    """Every sample of one request, its usage and its timings. ``text``,
    ``token_ids`` and ``finish_reason`` are sample 0's (all there is when
    n = 1); ``samples`` holds all n, by index."""

    request_id: str
    samples: list[Sample] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    timings: Durations | None = None  # None where the request never ended

    @property
    def text(self) -> str:
        return self.samples[0].text if self.samples else ""

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids if self.samples else []

    @property
    def finish_reason(self) -> str | None:
        return self.samples[0].finish_reason if self.samples else None

    @property
    def finish_reasons(self) -> list[str | None]:
        return [sample.finish_reason for sample in self.samples]

    def sample(self, index: int) -> Sample:
        """Sample `index`, made (with any before it) on first use."""
        while len(self.samples) <= index:
            self.samples.append(Sample(len(self.samples)))
        return self.samples[index]

    def add(self, index: int, token_ids: list[int], text: str, logprobs: list[float],
            finish_reason: str | None = None) -> None:
        """Append what one output or chunk brought to its sample."""
        sample = self.sample(index)
        sample.token_ids += token_ids
        sample.text += text
        sample.logprobs += logprobs
        if finish_reason:
            sample.finish_reason = finish_reason
