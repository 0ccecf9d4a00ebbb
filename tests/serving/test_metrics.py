"""Metrics scraped over real HTTP on 127.0.0.1, and the JSON log lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specpage.serve.logging_setup import configure_logging
from specpage.serve.metrics import Metrics


@dataclass
class Stats:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    in_use_blocks: int = 0
    tentative_blocks: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance: float = 0.0
    per_token_acceptance: float = 0.0
    current_k: float = 0.0
    preemptions: int = 0
    prefix_cached_tokens: int = 0
    prompt_tokens: int = 0
    total_blocks: int = 0
    accepted_by_position: tuple[int, ...] = ()
    aborts: int = 0
    sequences_without_draft: int = 0
    by_method: dict = field(default_factory=dict)
    suffix_cache_tokens: int = 0


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, from the exposition text."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


MODEL = ("model_name", "tiny")


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(model_name="tiny")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        return samples(response.read().decode())


def test_http_endpoint_serves_exact_values(metrics: Metrics) -> None:
    server = metrics.start_http("127.0.0.1", 0)
    try:
        metrics.observe_finish("stop")
        metrics.observe_finish("stop")
        metrics.observe_finish("length")
        metrics.observe_ttft(0.003)
        metrics.observe_ttft(0.2)
        metrics.observe_itl(0.02)
        metrics.update_engine(Stats(accepted_by_position=(5, 3, 1)))  # cumulative counts
        metrics.update_engine(Stats(accepted_by_position=(7, 5, 1)))
        got = scrape(server.port)
    finally:
        server.close()

    finished = "specpage_requests_finished_total"
    assert got[finished, (MODEL, ("reason", "stop"))] == 2
    assert got[finished, (MODEL, ("reason", "length"))] == 1
    assert got[finished, (MODEL, ("reason", "abort"))] == 0
    assert got["specpage_time_to_first_token_seconds_count", (MODEL,)] == 2
    assert got["specpage_time_to_first_token_seconds_sum", (MODEL,)] == pytest.approx(0.203)
    assert got["specpage_time_to_first_token_seconds_bucket", (("le", "0.001"), MODEL)] == 0
    assert got["specpage_time_to_first_token_seconds_bucket", (("le", "0.005"), MODEL)] == 1
    assert got["specpage_time_to_first_token_seconds_bucket", (("le", "0.25"), MODEL)] == 2
    assert got["specpage_time_to_first_token_seconds_bucket", (("le", "60.0"), MODEL)] == 2
    assert got["specpage_inter_token_latency_seconds_bucket", (("le", "0.01"), MODEL)] == 0
    assert got["specpage_inter_token_latency_seconds_bucket", (("le", "0.025"), MODEL)] == 1
    by_position = "specpage_accepted_tokens_by_position_total"
    assert got[by_position, (("position", "1"),)] == 7
    assert got[by_position, (("position", "2"),)] == 5
    assert got[by_position, (("position", "3"),)] == 1


def test_update_engine_sets_gauges_and_adds_counter_growth(metrics: Metrics) -> None:
    metrics.update_engine(
        Stats(running=3, waiting=2, free_blocks=10, cached_blocks=4, in_use_blocks=6,
              tentative_blocks=2, drafted_tokens=40, accepted_tokens=30, acceptance=0.75,
              current_k=4, preemptions=1, prefix_cached_tokens=32, prompt_tokens=128,
              total_blocks=20, aborts=2, sequences_without_draft=4)
    )  # fmt: skip
    metrics.update_engine(
        Stats(running=1, waiting=0, free_blocks=18, cached_blocks=2, in_use_blocks=0,
              drafted_tokens=100, accepted_tokens=60, acceptance=0.6,
              per_token_acceptance=0.7, current_k=3,
              preemptions=3, prefix_cached_tokens=64, prompt_tokens=256, total_blocks=20,
              aborts=5, sequences_without_draft=9, suffix_cache_tokens=1200)
    )  # fmt: skip
    got = samples(metrics.render().decode())

    assert got["specpage_requests_running", ()] == 1
    assert got["specpage_requests_waiting", ()] == 0
    assert got["specpage_kv_blocks", (("state", "free"),)] == 18
    assert got["specpage_kv_blocks", (("state", "cached"),)] == 2
    assert got["specpage_kv_blocks", (("state", "in_use"),)] == 0
    assert got["specpage_kv_blocks", (("state", "tentative"),)] == 0
    assert got["specpage_preemptions_total", ()] == 3
    assert got["specpage_sequences_without_draft_total", ()] == 9
    assert got["specpage_request_aborts_total", ()] == 5
    assert got["specpage_drafted_tokens_total", ()] == 100
    assert got["specpage_accepted_tokens_total", ()] == 60
    assert got["specpage_admitted_prompt_tokens_total", ()] == 256
    assert got["specpage_prefix_cached_tokens_total", ()] == 64
    assert got["specpage_prefix_cache_hit_ratio", ()] == 0.25
    assert got["specpage_acceptance_ratio", ()] == 0.6
    assert got["specpage_per_token_acceptance_ratio", ()] == 0.7
    assert got["specpage_spec_k", ()] == 3
    assert got["specpage_suffix_cache_tokens", ()] == 1200
    assert got["specpage_kv_cache_usage_ratio", ()] == 0.0


def test_speculation_counts_by_method_and_position(metrics: Metrics) -> None:
    metrics.update_engine(Stats(by_method={"ngram": (10, 6, (4, 2)), "draft": (8, 3, (3,))}))
    metrics.update_engine(Stats(by_method={"ngram": (15, 9, (5, 3, 1)),
                                           "draft": (8, 3, (3,)), "suffix": (4, 4, (2, 2))}))
    got = samples(metrics.render().decode())
    drafted, accepted = ("specpage_drafted_tokens_by_method_total",
                         "specpage_accepted_tokens_by_method_total")
    assert got[drafted, (("method", "ngram"),)] == 15
    assert got[accepted, (("method", "ngram"),)] == 9
    assert got[drafted, (("method", "draft"),)] == 8
    assert got[accepted, (("method", "suffix"),)] == 4
    by_position = "specpage_accepted_tokens_by_method_position_total"
    assert got[by_position, (("method", "ngram"), ("position", "1"))] == 5
    assert got[by_position, (("method", "ngram"), ("position", "3"))] == 1
    assert got[by_position, (("method", "suffix"), ("position", "2"))] == 2


def test_block_states_partition_the_pool(metrics: Metrics) -> None:
    metrics.update_engine(
        Stats(free_blocks=10, cached_blocks=4, in_use_blocks=6, tentative_blocks=2,
              total_blocks=20)
    )
    got = samples(metrics.render().decode())
    states = {"free": 10, "cached": 4, "in_use": 4, "tentative": 2}
    for state, count in states.items():
        assert got["specpage_kv_blocks", (("state", state),)] == count
    assert sum(states.values()) == 20
    assert got["specpage_kv_cache_usage_ratio", ()] == 6 / 20  # tentative blocks are in use


def test_observer_records_one_inter_token_latency_per_token(metrics: Metrics) -> None:
    from specpage.core.request import Timings, Usage
    from specpage.engine import RequestOutput
    from specpage.serve.daemon import MetricsObserver

    observe = MetricsObserver(metrics)
    end = dict(finished=True, finish_reason="length", usage=Usage(prompt_tokens=4),
               timings=Timings(arrival=10.0, first_scheduled=10.5, finished=12.0))
    steps = [
        [RequestOutput("a", 0, [5], "", 1), RequestOutput("b", 0, [1, 2], "", 2)],
        [RequestOutput("a", 0, [6, 7, 8], "", 4)],  # one step's accepted proposals
        [RequestOutput("a", 0, [9], "", 5, **end), RequestOutput("b", 0, [3], "", 3, **end)],
    ]
    for outputs in steps:
        observe(outputs, Stats(total_blocks=8, free_blocks=8))  # type: ignore[arg-type]
    got = samples(metrics.render().decode())

    # 5 + 3 tokens; every token but each sample's first is one observation
    assert got["specpage_generation_tokens_total", (MODEL,)] == 8
    assert got["specpage_inter_token_latency_seconds_count", (MODEL,)] == (5 - 1) + (3 - 1)
    assert got["specpage_prompt_tokens_total", (MODEL,)] == 8
    assert got["specpage_request_queue_time_seconds_count", (MODEL,)] == 2
    assert got["specpage_request_queue_time_seconds_sum", (MODEL,)] == 1.0
    assert got["specpage_e2e_request_latency_seconds_count", (MODEL,)] == 2
    assert got["specpage_e2e_request_latency_seconds_sum", (MODEL,)] == 4.0
    assert got["specpage_requests_finished_total", (MODEL, ("reason", "length"))] == 2


def test_noted_engine_figures_are_set_when_scraped(metrics: Metrics) -> None:
    """A step notes its stats; a scrape over HTTP (on the server's thread),
    one that names its metrics and a render each set the latest noted."""
    server = metrics.start_http("127.0.0.1", 0)
    try:
        for step in range(1, 4):
            metrics.note_engine(Stats(running=step, drafted_tokens=10 * step,  # type: ignore[arg-type]
                                      accepted_by_position=(step, 1)))
        got = scrape(server.port)
        assert got["specpage_requests_running", ()] == 3
        assert got["specpage_drafted_tokens_total", ()] == 30
        assert got["specpage_accepted_tokens_by_position_total", (("position", "1"),)] == 3
        assert got["specpage_accepted_tokens_by_position_total", (("position", "2"),)] == 1
        metrics.note_engine(Stats(running=1, drafted_tokens=45,  # type: ignore[arg-type]
                                  accepted_by_position=(5, 2, 1)))
        url = f"http://127.0.0.1:{server.port}/metrics?name[]=specpage_requests_running"
        with urllib.request.urlopen(url, timeout=5) as response:
            named = samples(response.read().decode())
        assert named == {("specpage_requests_running", ()): 1}
    finally:
        server.close()
    got = samples(metrics.render().decode())
    assert got["specpage_drafted_tokens_total", ()] == 45  # a counter grows by the difference
    assert got["specpage_accepted_tokens_by_position_total", (("position", "3"),)] == 1
    metrics.update_engine(Stats(running=7))  # type: ignore[arg-type]
    metrics.note_engine(Stats(running=2))  # type: ignore[arg-type]  # dropped by the next
    metrics.update_engine(Stats(running=4))  # type: ignore[arg-type]
    assert samples(metrics.render().decode())["specpage_requests_running", ()] == 4


def test_counter_restarts_with_a_new_engine(metrics: Metrics) -> None:
    metrics.update_engine(Stats(preemptions=5))
    metrics.update_engine(Stats(preemptions=2))  # a new engine, counting from 0 again
    assert samples(metrics.render().decode())["specpage_preemptions_total", ()] == 7


def test_registries_are_separate() -> None:
    first, second = Metrics(), Metrics()
    first.update_engine(Stats(aborts=3))  # type: ignore[arg-type]
    assert samples(first.render().decode())["specpage_request_aborts_total", ()] == 3
    assert samples(second.render().decode())["specpage_request_aborts_total", ()] == 0


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = configure_logging("info", stream)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_json_log_lines(json_log: io.StringIO) -> None:
    log = logging.getLogger("specpage.test")
    log.debug("below the level")
    log.info("admitted %d tokens", 12, extra={"request_id": "req-1", "queue": 3})
    try:
        raise RuntimeError("engine fault")
    except RuntimeError:
        log.exception("step failed\nsecond line", extra={"request_id": "req-2"})

    lines = json_log.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert set(first) == {"ts", "level", "logger", "msg", "request_id", "queue"}
    assert first["level"] == "info"
    assert first["logger"] == "specpage.test"
    assert first["msg"] == "admitted 12 tokens"
    assert (first["request_id"], first["queue"]) == ("req-1", 3)
    assert first["ts"].endswith("+00:00")
    assert second["msg"] == "step failed\nsecond line"
    assert second["level"] == "error"
    assert second["request_id"] == "req-2"
    assert second["exc"].endswith("RuntimeError: engine fault")


def test_configure_logging_replaces_only_its_own_handler(json_log: io.StringIO) -> None:
    root = logging.getLogger()
    before = list(root.handlers)
    second = io.StringIO()
    handler = configure_logging("warning", second)
    try:
        assert len(root.handlers) == len(before)
        logging.getLogger("specpage.test").warning("once")
        assert json_log.getvalue() == ""
        assert json.loads(second.getvalue())["msg"] == "once"
    finally:
        root.removeHandler(handler)


def test_configure_logging_rejects_unknown_level() -> None:
    with pytest.raises(ValueError, match="'loud'"):
        configure_logging("loud")


@pytest.mark.asyncio
async def test_a_real_daemon_counts_tokens_and_latencies_exactly(tmp_path: Path) -> None:
    """The draft is the target itself, so greedy proposals are all accepted and
    chunks carry several tokens: the inter-token latency count must still be
    one per token after each sample's first."""
    from specpage.client import Chunk, Client
    from tests.support.checkpoints import tiny_checkpoint
    from tests.support.daemon import Daemon, free_port

    models = tmp_path / "models"
    tiny_checkpoint(models / "target")
    tiny_checkpoint(models / "draft")  # the same seed: the same weights
    metrics_port = free_port()
    daemon = Daemon(tmp_path, server=f"metrics_port = {metrics_port}", gate=True)
    try:
        daemon.wait_serving()
        first = scrape(metrics_port)
        assert first["specpage_kv_blocks", (("state", "free"),)] == 512  # num_blocks
        assert first["specpage_kv_cache_usage_ratio", ()] == 0.0
        model = ("model_name", str(models / "target"))
        completions, prompts, chunk_sizes = [], [], []
        async with Client(daemon.address) as client:
            for length, max_tokens in ((5, 9), (11, 14), (3, 1)):
                prompt = list(range(1, length + 1))
                sizes = [len(event.token_ids) async for event in client.generate(
                    prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                    if isinstance(event, Chunk)]
                completions.append(sum(sizes))
                chunk_sizes += sizes
                prompts.append(length)
            while (await client.server_info()).pool.in_use:  # the last step's stats
                await asyncio.sleep(0.05)
            got = scrape(metrics_port)
            # a call left after its first chunk, while the step gate holds the
            # next step (399 to go): the server aborts its request
            gate = daemon.gate
            assert gate is not None
            events = client.generate([7, 8, 9], max_tokens=400, temperature=0.0,
                                     ignore_eos=True, spec="off")
            gate.close()
            try:
                first = asyncio.ensure_future(anext(events))
                await gate.wait_held()
                gate.allow()  # the prefill: the first token
                assert isinstance(await first, Chunk)
                await events.aclose()
            finally:
                gate.open()
            while (await client.server_info()).pool.in_use:
                await asyncio.sleep(0.05)
        aborted = scrape(metrics_port)
    finally:
        assert daemon.stop() == 0

    assert completions == [9, 14, 1] and max(chunk_sizes) > 1
    assert got["specpage_generation_tokens_total", (model,)] == sum(completions)
    assert got["specpage_prompt_tokens_total", (model,)] == sum(prompts)
    assert got["specpage_inter_token_latency_seconds_count", (model,)] == sum(
        n - 1 for n in completions)
    assert got["specpage_time_to_first_token_seconds_count", (model,)] == 3
    assert got["specpage_e2e_request_latency_seconds_count", (model,)] == 3
    assert got["specpage_request_queue_time_seconds_count", (model,)] == 3
    assert got["specpage_requests_finished_total", (model, ("reason", "length"))] == 3
    assert got["specpage_request_aborts_total", ()] == 0
    assert aborted["specpage_requests_finished_total", (model, ("reason", "abort"))] == 1
    assert aborted["specpage_request_aborts_total", ()] == 1
    assert got["specpage_kv_blocks", (("state", "in_use"),)] == 0
    assert got["specpage_kv_cache_usage_ratio", ()] == 0.0
