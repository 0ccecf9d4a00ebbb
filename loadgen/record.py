"""One request's timeline as the client saw it, and the latencies derived from it.

All times are seconds on the run's clock (time.perf_counter() minus the run's
start). Latencies count from `scheduled_s`, the arrival the load model asked
for, never from `sent_s`: if the client or a saturated server made the request
wait, that wait is part of what a user would have seen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

OUTCOMES = ("completed", "error", "cancelled", "unsent")  # sent = the first three


@dataclass(slots=True)
class RequestRecord:
    index: int
    warmup: bool
    request_id: str
    prompt_len: int  # tokens, or words for text prompts (over every message of a chat)
    max_tokens: int
    prefix_id: int | None = None
    cancel_after_s: float | None = None  # planned; None: never cancelled
    scheduled_s: float | None = None
    sent_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    end_s: float | None = None  # stream end: final event, error or cancellation
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, cumulative tokens)
    num_tokens: int = 0  # the server's cumulative num_tokens of sample 0
    outcome: str = "pending"  # one of OUTCOMES once done
    status: str = ""  # gRPC status code name
    error: str = ""
    finish_reason: str = ""
    retry_after_ms: int | None = None
    prompt_tokens: int | None = None  # server usage, from the final event
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    queue_s: float | None = None  # server timings, from the final event
    prefill_s: float | None = None
    server_total_s: float | None = None
    item: str | None = None  # --requests-file: the file and line of the request
    kind: str | None = None  # --requests-file: the entry's `kind`

    def add_chunk(self, now: float, num_tokens: int) -> None:
        """A chunk arrived carrying the server's cumulative count; counts never go back."""
        if num_tokens <= self.num_tokens:
            return  # a text-only flush: no new token, no new timing
        if self.first_token_s is None:
            self.first_token_s = now
        self.last_token_s = now
        self.num_tokens = num_tokens
        self.chunks.append((now, num_tokens))

    @property
    def send_lag_s(self) -> float | None:
        return _diff(self.sent_s, self.scheduled_s)

    @property
    def ttft_s(self) -> float | None:
        return _diff(self.first_token_s, self.scheduled_s)

    @property
    def e2e_s(self) -> float | None:
        return _diff(self.end_s, self.scheduled_s)

    @property
    def tpot_s(self) -> float | None:
        """(last token - first token) / (tokens - 1); None with fewer than two tokens."""
        if self.num_tokens < 2 or self.first_token_s is None or self.last_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.num_tokens - 1)

    def itl_s(self) -> list[float]:
        """One inter-token latency per token after the first.

        A chunk of k tokens that came g seconds after the previous one gives k gaps
        of g/k; extra tokens in the first chunk came with the first token (gap 0).
        So the mean of a request's ITLs is its TPOT, whatever the chunking.
        """
        gaps: list[float] = []
        previous_time, previous_count = None, 0
        for now, count in self.chunks:
            new = count - previous_count
            if previous_time is None:
                gaps.extend([0.0] * (new - 1))
            else:
                gaps.extend([(now - previous_time) / new] * new)
            previous_time, previous_count = now, count
        return gaps

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["chunks"] = [list(chunk) for chunk in self.chunks]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        known = {f.name for f in fields(cls)}
        record = cls(**{key: value for key, value in data.items() if key in known})
        record.chunks = [(float(now), int(count)) for now, count in record.chunks]
        return record


CSV_DERIVED = ("send_lag_s", "ttft_s", "tpot_s", "e2e_s")
CSV_FIELDS = (
    *(f.name for f in fields(RequestRecord) if f.name != "chunks"), *CSV_DERIVED, "num_chunks"
)


def csv_row(record: RequestRecord) -> dict[str, Any]:
    """The flat per-request row: raw fields plus derived latencies, chunks left out."""
    row = {name: getattr(record, name) for name in CSV_FIELDS if name != "num_chunks"}
    row["num_chunks"] = len(record.chunks)
    return row


def _diff(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier
