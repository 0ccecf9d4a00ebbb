"""Prometheus metrics of one daemon, in a registry of its own.

Never the global registry: tests (and, one day, several engines in one process)
make as many ``Metrics`` as they like without name clashes.

The request-level metrics carry a ``model_name`` label (the configured target),
as vLLM's do. Six of them follow vLLM's names under the ``specpage_`` prefix
(time to first token, inter-token latency, end-to-end latency, queue time,
generation and prompt tokens: ``vllm:e2e_request_latency_seconds`` is
``specpage_e2e_request_latency_seconds``), so a vLLM dashboard's latency and
throughput panels need only the prefix changed; the rest (requests, KV blocks,
speculation, preemptions) have names of their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import RestrictedRegistry

from specpage.core.request import FinishReason

NAMESPACE = "specpage"
# Seconds, 1 ms .. 60 s: sub-token ITL on a GPU up to a long queue before the first token.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
BLOCK_STATES = ("free", "cached", "in_use", "tentative")


class EngineStatsLike(Protocol):
    """What update_engine reads; the token and preemption counts are cumulative."""

    running: int
    waiting: int
    free_blocks: int
    cached_blocks: int
    in_use_blocks: int  # includes tentative_blocks, as in the pool
    tentative_blocks: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance: float
    per_token_acceptance: float
    current_k: float
    preemptions: int
    prefix_cached_tokens: int
    prompt_tokens: int
    total_blocks: int
    aborts: int
    sequences_without_draft: int
    accepted_by_position: tuple[int, ...]  # acceptances at proposal 1, 2, ..., cumulative
    # method -> (drafted, accepted, accepted_by_position), cumulative
    by_method: Mapping[str, tuple[int, int, tuple[int, ...]]]
    suffix_cache_tokens: int  # earlier requests' tokens the suffix cache holds (bounded)


class _CumulativeCounter:
    """A Counter fed from a count the engine keeps; it adds the growth since last time."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.last = 0

    def set(self, total: int) -> None:
        # A smaller total means a new engine counting from zero; counters never go down.
        self.counter.inc(total - self.last if total >= self.last else total)
        self.last = total


class _Registry(CollectorRegistry):
    """A registry that first runs `before_collect` whenever it is collected:
    a scrape of /metrics on its own thread, or `Metrics.render`."""

    def __init__(self, before_collect: Callable[[], None]) -> None:
        super().__init__()
        self.before_collect = before_collect

    def collect(self) -> Iterator[Metric]:
        self.before_collect()
        yield from super().collect()

    def restricted_registry(self, names: Iterable[str]) -> RestrictedRegistry:
        # a scrape that names its metrics (/metrics?name[]=...) collects through this
        self.before_collect()
        return super().restricted_registry(names)


@dataclass
class MetricsServer:
    """The /metrics HTTP endpoint, served by a daemon thread."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class Metrics:
    """The daemon's metrics. Per-request figures are observed as they happen;
    the engine's counts and gauges (`EngineStatsLike`) are noted each step
    by reference (`note_engine`) and set when the registry is collected: a
    step streaming a token then pays for no metric updates beside it on the
    event loop, which shares the cores (and the interpreter) with the step."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = _Registry(self._apply_noted)
        self._noted: EngineStatsLike | None = None  # the latest step's
        self._applied: EngineStatsLike | None = None  # the last set into the metrics
        self._applying = threading.Lock()  # scrapes come on more than one thread
        self.model_name = model_name
        r, ns, model = self.registry, NAMESPACE, {"model_name": model_name}
        self.finished = Counter(
            "requests_finished", "Finished requests by finish reason", ["model_name", "reason"],
            namespace=ns, registry=r,
        )  # fmt: skip
        self.aborts = _CumulativeCounter(Counter(
            "request_aborts", "Requests aborted before they finished: client cancel, "
            "disconnect, call deadline, Abort RPC, drain", namespace=ns, registry=r,
        ))  # fmt: skip
        self.preemptions = _CumulativeCounter(Counter(
            "preemptions", "Sequences preempted by recompute", namespace=ns, registry=r,
        ))  # fmt: skip
        self.without_draft = _CumulativeCounter(Counter(
            "sequences_without_draft", "New sequences a draft head was left off while "
            "speculation did not pay (they never speculate)", namespace=ns, registry=r,
        ))  # fmt: skip
        self.waiting = Gauge("requests_waiting", "Requests waiting", namespace=ns, registry=r)
        self.running = Gauge("requests_running", "Requests running", namespace=ns, registry=r)
        self.ttft = Histogram(
            "time_to_first_token_seconds", "Arrival (the start of the call) to first token",
            ["model_name"], namespace=ns, registry=r, buckets=LATENCY_BUCKETS,
        ).labels(**model)  # fmt: skip
        self.itl = Histogram(
            "inter_token_latency_seconds", "Time between successive tokens of a sample, "
            "one observation per token after the first",
            ["model_name"], namespace=ns, registry=r, buckets=LATENCY_BUCKETS,
        ).labels(**model)  # fmt: skip
        self.e2e = Histogram(
            "e2e_request_latency_seconds",
            "Arrival (the start of the call) to the request's last token",
            ["model_name"], namespace=ns, registry=r, buckets=LATENCY_BUCKETS,
        ).labels(**model)  # fmt: skip
        self.queue_time = Histogram(
            "request_queue_time_seconds", "Arrival (the start of the call) to first scheduled",
            ["model_name"], namespace=ns, registry=r, buckets=LATENCY_BUCKETS,
        ).labels(**model)  # fmt: skip
        self.generation_tokens = Counter(
            "generation_tokens", "Tokens generated, all samples",
            ["model_name"], namespace=ns, registry=r,
        ).labels(**model)  # fmt: skip
        self.prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens of ended requests, each counted once",
            ["model_name"], namespace=ns, registry=r,
        ).labels(**model)  # fmt: skip
        self.blocks = Gauge(
            "kv_blocks", "KV pool blocks by state; the states partition the pool "
            "(in_use excludes tentative)", ["state"], namespace=ns, registry=r,
        )  # fmt: skip
        self.admitted_prompt_tokens = _CumulativeCounter(Counter(
            "admitted_prompt_tokens", "Prompt tokens admitted, recomputes after preemption "
            "included (the prefix cache hit ratio's denominator)", namespace=ns, registry=r,
        ))  # fmt: skip
        self.prefix_cached_tokens = _CumulativeCounter(Counter(
            "prefix_cached_tokens", "Prompt tokens served from the prefix cache",
            namespace=ns, registry=r,
        ))  # fmt: skip
        self.prefix_hit_ratio = Gauge(
            "prefix_cache_hit_ratio",
            "Prefix-cached prompt tokens / admitted prompt tokens, since start",
            namespace=ns, registry=r,
        )  # fmt: skip
        self.kv_usage = Gauge(
            "kv_cache_usage_ratio", "KV blocks in use (tentative included) / all blocks",
            namespace=ns, registry=r,
        )  # fmt: skip
        self.drafted = _CumulativeCounter(Counter(
            "drafted_tokens", "Draft tokens proposed", namespace=ns, registry=r,
        ))  # fmt: skip
        self.accepted = _CumulativeCounter(Counter(
            "accepted_tokens", "Draft tokens accepted by the target", namespace=ns, registry=r,
        ))  # fmt: skip
        self.accepted_by_position = Counter(
            "accepted_tokens_by_position", "Accepted draft tokens by proposal position (1..k)",
            ["position"], namespace=ns, registry=r,
        )  # fmt: skip
        self.drafted_by_method = Counter(
            "drafted_tokens_by_method",
            "Tokens proposed, by method (draft, ngram, suffix, grammar)",
            ["method"], namespace=ns, registry=r,
        )  # fmt: skip
        self.accepted_by_method = Counter(
            "accepted_tokens_by_method", "Proposed tokens the target accepted, by method",
            ["method"], namespace=ns, registry=r,
        )  # fmt: skip
        self.accepted_by_method_position = Counter(
            "accepted_tokens_by_method_position",
            "Accepted proposed tokens by method and proposal position (1..)",
            ["method", "position"], namespace=ns, registry=r,
        )  # fmt: skip
        # (family, its labels) -> the engine-fed series, made when first seen
        self._series: dict[tuple[object, ...], _CumulativeCounter] = {}
        self.spec_k = Gauge("spec_k", "Current proposal length k", namespace=ns, registry=r)
        self.suffix_cache_tokens = Gauge(
            "suffix_cache_tokens", "Earlier requests' tokens the suffix cache holds "
            "(at most engine.spec_suffix_cache_tokens)", namespace=ns, registry=r)
        self.acceptance = Gauge(
            "acceptance_ratio", "Accepted / drafted tokens, since start", namespace=ns, registry=r
        )
        self.per_token_acceptance = Gauge(
            "per_token_acceptance_ratio",
            "Accepted / tested draft tokens (a proposal is tested when all before it were "
            "accepted), since start", namespace=ns, registry=r,
        )
        # Series that exist from the start, at 0, so rate() and sums see them at once.
        for reason in FinishReason:
            self.finished.labels(model_name=model_name, reason=reason.value)
        for state in BLOCK_STATES:
            self.blocks.labels(state=state)

    def observe_finish(self, reason: str) -> None:
        self.finished.labels(model_name=self.model_name, reason=reason).inc()


    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float, tokens: int = 1) -> None:
        """tokens tokens, each seconds after the one before it."""
        for _ in range(tokens):
            self.itl.observe(seconds)

    def observe_generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)

    def observe_request_end(self, prompt_tokens: int, queue_s: float | None,
                            e2e_s: float) -> None:
        """Once per request; queue_s is None for a request never scheduled."""
        self.prompt_tokens.inc(prompt_tokens)
        if queue_s is not None:
            self.queue_time.observe(queue_s)
        self.e2e.observe(e2e_s)

    def note_engine(self, stats: EngineStatsLike) -> None:
        """The engine's latest figures, applied at the next collection (a
        reference kept: stats is a snapshot that nothing changes after)."""
        self._noted = stats

    def _apply_noted(self) -> None:
        # The step's thread only ever replaces _noted: one noted while this
        # runs is applied by the next collection, never lost.
        with self._applying:
            stats = self._noted
            if stats is not None and stats is not self._applied:
                self._update_engine(stats)
                self._applied = stats

    def update_engine(self, stats: EngineStatsLike) -> None:
        """Set the engine's figures now (as if noted and collected)."""
        with self._applying:
            self._noted = self._applied = stats
            self._update_engine(stats)

    def _update_engine(self, stats: EngineStatsLike) -> None:
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        states = {
            "free": stats.free_blocks,
            "cached": stats.cached_blocks,
            "in_use": stats.in_use_blocks - stats.tentative_blocks,
            "tentative": stats.tentative_blocks,
        }
        for state, count in states.items():
            self.blocks.labels(state=state).set(count)
        self.preemptions.set(stats.preemptions)
        self.aborts.set(stats.aborts)
        self.without_draft.set(stats.sequences_without_draft)
        self.kv_usage.set(stats.in_use_blocks / max(1, stats.total_blocks))
        self.admitted_prompt_tokens.set(stats.prompt_tokens)
        self.prefix_cached_tokens.set(stats.prefix_cached_tokens)
        self.prefix_hit_ratio.set(stats.prefix_cached_tokens / max(1, stats.prompt_tokens))
        self.drafted.set(stats.drafted_tokens)
        self.accepted.set(stats.accepted_tokens)
        self.acceptance.set(stats.acceptance)
        self.per_token_acceptance.set(stats.per_token_acceptance)
        self.spec_k.set(stats.current_k)
        self.suffix_cache_tokens.set(stats.suffix_cache_tokens)
        for position, count in enumerate(stats.accepted_by_position, start=1):
            self._series_of(self.accepted_by_position, position=str(position)).set(count)
        for method, (drafted, accepted, by_position) in stats.by_method.items():
            self._series_of(self.drafted_by_method, method=method).set(drafted)
            self._series_of(self.accepted_by_method, method=method).set(accepted)
            for position, count in enumerate(by_position, start=1):
                self._series_of(self.accepted_by_method_position, method=method,
                                position=str(position)).set(count)

    def _series_of(self, family: Counter, **labels: str) -> _CumulativeCounter:
        """The engine-fed series of a labelled counter family."""
        key = (family, *labels.items())
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _CumulativeCounter(family.labels(**labels))
        return series

    def start_http(self, host: str, port: int) -> MetricsServer:
        """Serve /metrics for this registry on host:port (0: a free port)."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsServer(server, thread)

    def render(self) -> bytes:
        return generate_latest(self.registry)
