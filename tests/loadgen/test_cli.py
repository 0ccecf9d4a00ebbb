"""The loadgen command line: bad input exits 2 with one clear line; runs write their files."""

import json
import math
import shutil
import socket
import subprocess
import time
from concurrent import futures

import grpc
import pytest

from loadgen import selfcheck
from loadgen.cli import build_parser, main
from loadgen.options import workload
from specpage.serve.grpc_stubs import generation_pb2 as pb
from specpage.serve.grpc_stubs import generation_pb2_grpc as pb_grpc

BASE = ["run", "--no-selfcheck", "--no-progress", "--health-timeout", "0"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rate", "5", "--requests", "3", "--slo", "ttft=2000"], "needs a unit"),
        (["--rate", "5", "--requests", "3", "--slo", "ttft<2s"], "KEY=DURATION"),
        (["--rate", "5", "--requests", "3", "--slo", "speed=1s"], "unknown key"),
        (["--rate", "-1", "--requests", "3"], "--rate must be"),
        (["--rate", "inf", "--requests", "3"], "--rate must be"),
        (["--rate", "5"], "--requests N or --duration D"),
        (["--requests", "5"], "--rate R"),
        (["--rate", "5", "--concurrency", "2", "--requests", "3"], "exclude each other"),
        (["--rate", "5", "--requests", "0"], "--requests must be >= 1"),
        (["--rate", "5", "--duration", "-3s"], "--duration"),
        (["--rate", "5", "--requests", "3", "--burstiness", "2"], "--arrival gamma"),
        (["--rate", "5", "--requests", "3", "--arrival", "gamma", "--burstiness", "0"],
         "--burstiness must be > 0"),
        (["--trace", "/nonexistent/trace.jsonl"], "cannot read"),
        (["--rate", "5", "--requests", "3", "--prompt-len", "zipf:2"], "unknown distribution"),
        (["--rate", "5", "--requests", "3", "--cancel-fraction", "1.5"], "within 0..1"),
        (["--rate", "5", "--requests", "3", "--prompts-file", "/nonexistent"], "cannot read"),
        (["--rate", "5", "--requests", "3", "--chat"], "needs --prompts-file"),
        (["--rate", "5", "--requests", "3", "--token", "a", "--token-file", "b"], "not both"),
        (["--rate", "5", "--requests", "3", "--tls-ca", "/nonexistent.pem"], "--tls-ca"),
        (["--rate", "5", "--requests", "3", "--target", "localhost"], "HOST:PORT"),
        (["--rate", "five", "--requests", "3"], "invalid float value"),
        (["--rate", "5", "--requests", "3", "--spec", "maybe"], "invalid choice"),
    ],
)
def test_bad_input_exits_2_with_a_message(flags, message, capsys):
    assert main([*BASE, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "trace.jsonl:2: not JSON"),
        ('{"offset_s": 1, "output_len": 4}', "exactly one of"),
        ('{"offset_s": -1, "prompt_len": 3, "output_len": 4}', "offset_s"),
        ('{"offset_s": 1, "prompt_len": 3, "output_len": 0}', "output_len"),
        ('{"offset_s": 1, "prompt_len": 3, "output_len": 2, "extra": 1}', "unknown key"),
        ('{"offset_s": 1, "prompt_len": 3, "output_len": 2, "sampling": {"n": 2}}', "'n'"),
        ('{"offset_s": 1, "prompt_token_ids": [1, -2], "output_len": 2}', "prompt_token_ids"),
    ],
)
def test_malformed_trace_lines_are_named(line, message, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"offset_s": 0, "prompt_len": 3, "output_len": 4}\n' + line + "\n")
    assert main([*BASE, "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_report_of_a_bad_file_exits_2(tmp_path, capsys):
    junk = tmp_path / "junk.json"
    junk.write_text("{oops")
    assert main(["report", str(junk)]) == 2
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "other.json").write_text('{"kind": "other"}')
    assert main(["report", str(tmp_path / "other.json")]) == 2
    err = capsys.readouterr().err
    assert "not JSON" in err and "cannot read" in err and "not a loadgen report" in err


def test_unwritable_output_folder_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main([*BASE, "--rate", "5", "--requests", "3", "--out", str(blocker / "sub")]) == 2
    assert "--out: cannot create" in capsys.readouterr().err


def test_unknown_subcommand_and_flag_exit_2(capsys):
    assert main(["launch"]) == 2
    assert main(["run", "--frobnicate"]) == 2
    assert "unrecognized arguments" in capsys.readouterr().err


class Echo(pb_grpc.GenerationServicer):
    """A threaded fake: 20 ms to the first token, then two-token chunks every 5 ms."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []

    def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.token and self.metadata[-1].get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        time.sleep(0.02)
        count = 0
        while count < request.sampling.max_tokens:
            step = min(2, request.sampling.max_tokens - count)
            count += step
            yield pb.GenerateEvent(chunk=pb.Chunk(token_ids=[5] * step, num_tokens=count))
            time.sleep(0.005)
        usage = pb.Usage(prompt_tokens=len(request.token_ids), completion_tokens=count)
        yield pb.GenerateEvent(final=pb.Final(usage=usage, finish_reason="length"))


@pytest.fixture
def echo_server():
    servicer = Echo()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None).wait()


def test_run_writes_report_csv_and_plot_then_report_rerenders(echo_server, tmp_path, capsys):
    servicer, address = echo_server
    out = tmp_path / "out"
    code = main([
        *BASE, "--target", address, "--rate", "40", "--requests", "12", "--warmup", "2",
        "--output-len", "uniform:3,9", "--vocab-size", "211", "--seed", "3", "--spec", "on",
        "--temperature", "0", "--token", "s3cret", "--slo", "ttft=30s,e2e=60s",
        "--out", str(out),
    ])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "run" and len(report["records"]) == 14
    assert "s3cret" not in (out / "report.json").read_text()
    counts = report["summary"]["counts"]
    assert counts["completed"] == counts["sent"] == counts["measured"] == 12
    assert report["summary"]["slo_attainment"] == 1.0  # SLOs whatever completes meets
    rows = (out / "records.csv").read_text().splitlines()
    assert len(rows) == 15 and rows[0].startswith("index,warmup,request_id")
    assert (out / "latency_cdf.png").stat().st_size > 10_000
    # What went over the wire:
    assert len(servicer.requests) == 14
    first = servicer.requests[0]
    assert first.spec == pb.SPEC_ON and first.sampling.temperature == 0.0
    assert first.sampling.ignore_eos and all(t < 211 for t in first.token_ids)
    assert servicer.metadata[0]["authorization"] == "Bearer s3cret"
    for record in report["records"]:
        assert record["num_tokens"] == record["max_tokens"] == record["completion_tokens"]
    # Re-render from the saved JSON, judged against a stricter SLO.
    (out / "latency_cdf.png").unlink()
    capsys.readouterr()
    assert main(["report", str(out / "report.json"), "--slo", "ttft=1ms"]) == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "attainment 0.0%" in printed
    assert (out / "latency_cdf.png").is_file()


def test_same_seed_same_requests(echo_server, tmp_path):
    servicer, address = echo_server
    flags = [*BASE, "--target", address, "--rate", "100", "--requests", "5",
             "--prompt-len", "lognormal:12,0.5", "--vocab-size", "211", "--seed", "9",
             "--no-plots"]
    assert main([*flags, "--out", str(tmp_path / "a")]) == 0
    assert main([*flags, "--out", str(tmp_path / "b")]) == 0
    first, second = servicer.requests[:5], servicer.requests[5:]
    key = lambda r: (list(r.token_ids), r.sampling.max_tokens, r.sampling.seed)  # noqa: E731
    assert sorted(map(key, first)) == sorted(map(key, second))


def test_runs_send_no_seeds_and_a_fresh_cache_salt_by_default(echo_server, tmp_path, capsys):
    servicer, address = echo_server
    flags = [*BASE, "--target", address, "--rate", "100", "--requests", "4", "--output-len", "2",
             "--vocab-size", "211", "--seed", "9", "--no-plots"]
    reports = []
    for name in ("a", "b"):
        assert main([*flags, "--out", str(tmp_path / name)]) == 0
        reports.append(json.loads((tmp_path / name / "report.json").read_text()))
    printed = capsys.readouterr().out
    assert not any(r.sampling.HasField("seed") for r in servicer.requests)
    salts = [r.cache_salt for r in servicer.requests]
    first, second = salts[:4], salts[4:]
    assert len(set(first)) == len(set(second)) == 1 and first[0] != second[0]
    assert first[0].startswith("loadgen-") and len(first[0]) == len("loadgen-") + 16
    assert [r["policy"] for r in reports] == [
        {"prefix_cache": "fresh per run", "cache_salt": salt, "request_seeds": False}
        for salt in (first[0], second[0])
    ]
    assert f"a fresh cache_salt per run ({first[0]})" in printed
    assert "requests unseeded" in printed
    # `loadgen report` says the same from the saved JSON.
    assert main(["report", str(tmp_path / "a" / "report.json")]) == 0
    assert f"a fresh cache_salt per run ({first[0]})" in capsys.readouterr().out


def test_request_seeds_and_a_shared_prefix_cache_on_request(echo_server, tmp_path, capsys):
    servicer, address = echo_server
    out = tmp_path / "out"
    assert main([*BASE, "--target", address, "--rate", "100", "--requests", "4",
                 "--output-len", "2", "--vocab-size", "211", "--seed", "9", "--no-plots",
                 "--request-seeds", "--share-prefix-cache", "--out", str(out)]) == 0
    work = workload(build_parser().parse_args([*BASE, "--vocab-size", "211", "--seed", "9",
                                               "--output-len", "2"]))
    expected = {tuple(work.request(i, False, 0.0).prompt): work.request(i, False, 0.0).seed
                for i in range(4)}
    sent = {tuple(r.token_ids): r.sampling.seed for r in servicer.requests}
    assert all(r.sampling.HasField("seed") for r in servicer.requests)
    assert sent == expected
    assert {r.cache_salt for r in servicer.requests} == {""}
    report = json.loads((out / "report.json").read_text())
    assert report["policy"] == {"prefix_cache": "shared", "cache_salt": "", "request_seeds": True}
    printed = capsys.readouterr().out
    assert "shared with earlier runs (--share-prefix-cache)" in printed
    assert "seeded from --seed (--request-seeds)" in printed


def test_closed_loop_trace_and_token_file(echo_server, tmp_path):
    servicer, address = echo_server
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"offset_s": 0.0, "prompt_token_ids": [1, 2, 3], "output_len": 2}\n'
        '{"offset_s": 0.05, "prompt": "hello world", "output_len": 3,'
        ' "sampling": {"temperature": 0.5, "stop": ["x"]}}\n'
        '{"offset_s": 0.1, "prompt_len": 4, "output_len": 4}\n'
    )
    token = tmp_path / "token"
    token.write_text("tok\n")
    common = [*BASE, "--target", address, "--vocab-size", "50", "--no-plots",
              "--token-file", str(token)]
    assert main([*common, "--trace", str(trace), "--out", str(tmp_path / "t")]) == 0
    report = json.loads((tmp_path / "t" / "report.json").read_text())
    assert [r["num_tokens"] for r in report["records"]] == [2, 3, 4]
    texts = [r for r in servicer.requests if r.text]
    assert texts[0].text == "hello world" and texts[0].sampling.temperature == 0.5
    assert list(texts[0].sampling.stop) == ["x"]
    assert servicer.metadata[0]["authorization"] == "Bearer tok"
    assert main([*common, "--concurrency", "3", "--requests", "9", "--out",
                 str(tmp_path / "c")]) == 0
    closed = json.loads((tmp_path / "c" / "report.json").read_text())
    assert closed["summary"]["counts"]["completed"] == 9
    assert any("coordinated omission" in w for w in closed["warnings"])


def test_sweep_finds_a_knee_and_plots_the_curve(echo_server, tmp_path, capsys):
    _, address = echo_server
    out = tmp_path / "sweep"
    code = main([
        "sweep", "--no-selfcheck", "--no-progress", "--health-timeout", "0", "--target", address,
        "--requests", "6", "--output-len", "2", "--vocab-size", "211", "--slo", "e2e=60s",
        "--start-rate", "20", "--max-steps", "2", "--bisect-steps", "1", "--out", str(out),
    ])
    assert code == 0
    saved = json.loads((out / "sweep.json").read_text())
    assert [p["rate"] for p in saved["points"]] == [20, 40, 80]
    assert saved["sweep"]["knee_rate"] == 80 and saved["sweep"]["failed_rate"] is None
    assert (out / "sweep.png").is_file() and (out / "latency_cdf.png").is_file()
    assert len((out / "records.csv").read_text().splitlines()) == 1 + 18
    # Each point is its own run with its own cache namespace.
    salts = [p["cache_salt"] for p in saved["points"]]
    assert len(set(salts)) == 3 and all(salt.startswith("loadgen-") for salt in salts)
    assert saved["policy"]["prefix_cache"] == "fresh per run"
    assert main(["report", str(out / "sweep.json")]) == 0
    assert "sweep" in capsys.readouterr().out


def test_sweep_needs_an_slo(capsys):
    assert main(["sweep", "--requests", "3"]) == 2
    assert "--slo" in capsys.readouterr().err


def test_unreachable_target_exits_1(tmp_path, capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = main(["run", "--no-selfcheck", "--no-progress", "--target", f"127.0.0.1:{port}",
                 "--health-timeout", "0.5s", "--rate", "5", "--requests", "2",
                 "--out", str(tmp_path)])
    assert code == 1
    assert "is not serving" in capsys.readouterr().err


def test_selfcheck_command_prints_its_figure(capsys, monkeypatch):
    # Whether a probed rate stays on schedule depends on how busy the machine is: with
    # limits every probe meets, the burst rate is confirmed and printed.
    monkeypatch.setattr(selfcheck, "LAG_LIMIT_S", math.inf)
    monkeypatch.setattr(selfcheck, "E2E_LIMIT_S", math.inf)
    assert main(["selfcheck", "--output-len", "4"]) == 0
    assert "self-check: this client sustains" in capsys.readouterr().out


def test_selfcheck_command_says_when_no_rate_held(capsys, monkeypatch):
    monkeypatch.setattr(selfcheck, "LAG_LIMIT_S", -1.0)  # no send lag is below it
    assert main(["selfcheck", "--output-len", "4"]) == 0
    assert "self-check: no probed rate stayed on schedule" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_a_private_ca_and_a_bearer_token(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )
    servicer = Echo(token="right")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        flags = [*BASE, "--target", f"127.0.0.1:{port}", "--tls-ca", str(cert), "--rate", "50",
                 "--requests", "3", "--output-len", "2", "--no-plots"]
        assert main([*flags, "--token", "right", "--out", str(tmp_path / "ok")]) == 0
        assert main([*flags, "--token", "wrong", "--out", str(tmp_path / "bad")]) == 0
    finally:
        server.stop(None).wait()
    good = json.loads((tmp_path / "ok" / "report.json").read_text())["summary"]["counts"]
    bad = json.loads((tmp_path / "bad" / "report.json").read_text())["summary"]["counts"]
    assert good["completed"] == 3
    assert bad["errors_by_status"] == {"UNAUTHENTICATED": 3}
