"""loadgen against the real daemon: tiny random Llama pair, a few seconds of Poisson load."""

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadgen.cli import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("specpage.serve.grpc_server") is None,
    reason="specpage.serve.grpc_server not written yet",
)
SERVING_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
REQUESTS = 20


def tiny_llama(folder: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_serving(address: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVING_TIMEOUT_S
    request = health_pb2.HealthCheckRequest(service="specpage.v1.Generation")
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert process.poll() is None, f"daemon exited:\n{log.read_text()}"
            try:
                if stub.Check(request, timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"not SERVING after {SERVING_TIMEOUT_S:g}s:\n{log.read_text()}")


@pytest.fixture
def daemon(tmp_path):
    tiny_llama(tmp_path / "target", seed=0)
    tiny_llama(tmp_path / "draft", seed=1)
    port = free_port()
    config = tmp_path / "specpage.toml"
    config.write_text(
        f'[model]\ntarget = "{tmp_path / "target"}"\ndraft = "{tmp_path / "draft"}"\n'
        "[engine]\nblock_size = 4\nnum_blocks = 512\n"
        f'[server]\nhost = "127.0.0.1"\nport = {port}\n'
    )
    log = tmp_path / "daemon.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "specpage", "serve", "--config", str(config)],
            stdout=sink, stderr=subprocess.STDOUT,
        )
    try:
        wait_serving(f"127.0.0.1:{port}", process, log)
        yield f"127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    assert code == 0, log.read_text()


def test_short_run_accounts_for_every_request(daemon, tmp_path, capsys):
    out = tmp_path / "results"
    code = main([
        "run", "--target", daemon, "--no-progress", "--rate", "5", "--requests", str(REQUESTS),
        "--warmup", "2", "--prompt-len", "uniform:4,24", "--output-len", "uniform:8,48",
        "--vocab-size", "211", "--temperature", "0", "--cancel-fraction", "0.3",
        "--cancel-max-delay", "150ms", "--prefix-fraction", "0.5", "--prefix-len", "8",
        "--slo", "ttft=2s,tpot=500ms", "--seed", "11", "--out", str(out),
    ])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert (out / "records.csv").is_file() and (out / "latency_cdf.png").stat().st_size > 10_000
    counts = report["summary"]["counts"]
    assert counts["measured"] == REQUESTS and counts["unsent"] == 0
    finished = counts["completed"] + counts["errors"] + counts["cancelled"]
    assert finished == counts["sent"] == REQUESTS
    assert counts["errors"] == 0, counts["errors_by_status"]
    # Whether a probed rate stays on schedule depends on how busy the machine is; the
    # rules that pick it are tested in test_measure.py.
    selfcheck = report["selfcheck"]
    assert selfcheck["burst_rate"] > 0
    sustained = selfcheck["sustained_rate"]
    assert sustained is None or sustained <= selfcheck["burst_rate"]
    records = report["records"]
    assert len(records) == REQUESTS + 2
    planned_cancels = [r for r in records if r["cancel_after_s"] is not None]
    assert planned_cancels
    for record in records:
        if record["outcome"] == "cancelled":
            assert record["cancel_after_s"] is not None and record["status"] == "CANCELLED"
            # never before its time (1 ms: the timer's clock and the run's are read apart)
            assert record["end_s"] - record["sent_s"] >= record["cancel_after_s"] - 0.001
        elif record["outcome"] == "completed":
            # ignore_eos: exactly the asked length, as counted by the server's num_tokens.
            # With a cancel planned, this shows it finished before the cancel came: one
            # that took effect would have cut the stream and counted it cancelled. (How
            # long after the planned moment its end was seen is the machine's speed.)
            assert record["num_tokens"] == record["max_tokens"] == record["completion_tokens"]
    assert report["summary"]["latency"]["ttft_s"]["count"] == counts["completed"]


def cached_tokens(daemon: str, out: Path, *extra: str) -> int:
    """One short run of the same 8 prompts; the prompt tokens the server served from cache."""
    code = main([
        "run", "--target", daemon, "--no-progress", "--no-selfcheck", "--no-plots",
        "--rate", "20", "--requests", "8", "--prompt-len", "24", "--output-len", "4",
        "--vocab-size", "211", "--temperature", "0", "--seed", "5", "--out", str(out), *extra,
    ])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    records = report["records"]
    assert [r["outcome"] for r in records] == ["completed"] * 8
    # The summary's figure is the final usage's cached_tokens, summed.
    assert report["summary"]["cached_tokens"] == sum(r["cached_tokens"] for r in records)
    assert report["summary"]["prompt_tokens"] == 8 * 24
    return int(report["summary"]["cached_tokens"])


def test_each_run_starts_with_a_cold_prefix_cache_unless_shared(daemon, tmp_path):
    # Random token prompts share no block within a run, so a cold run caches nothing.
    assert cached_tokens(daemon, tmp_path / "a") == 0
    assert cached_tokens(daemon, tmp_path / "b") == 0  # same prompts, fresh cache_salt
    shared = ("--share-prefix-cache",)
    assert cached_tokens(daemon, tmp_path / "c", *shared) == 0  # the shared namespace is new
    # Every full 4-token block of each 24-token prompt but the last, which the server
    # recomputes so that the prompt's last position yields logits.
    assert cached_tokens(daemon, tmp_path / "d", *shared) == 8 * 20
