"""Start-up failures of a real `specpage serve`: exit status 1, one JSON error
line that says what to fix, no traceback, and ports checked before any model
loads."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specpage.models.fetch import known_models
from tests.support.checkpoints import tiny_checkpoint
from tests.support.daemon import Daemon, free_port, tiny_pair

START_TIMEOUT_S = 120  # a generous bound on a failed start; never a speed assertion


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("startup")
    tiny_pair(folder / "models")
    tiny_checkpoint(folder / "models" / "other-vocab", num_hidden_layers=1, vocab_size=300)
    return folder / "models"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port with a listener on 127.0.0.1 that is no daemon's."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def serve(folder: Path, models: Path, model: str = "", server: str = "") -> dict[str, Any]:
    """Run `specpage serve` to its failure; its stderr lines as dicts."""
    model = model or f'target = "{models / "target"}"\ndraft = "{models / "draft"}"'
    config = folder / "specpage.toml"
    config.write_text(f"[model]\n{model}\n[engine]\nblock_size = 4\nnum_blocks = 64\n"
                      f'[server]\nhost = "127.0.0.1"\n{server or f"port = {free_port()}"}\n')
    result = subprocess.run(
        [sys.executable, "-m", "specpage", "serve", "--config", str(config)],
        capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "Event loop is closed" not in result.stderr
    assert result.stdout == ""
    lines = [json.loads(line) for line in result.stderr.splitlines()]  # all JSON
    errors = [line for line in lines if line["level"] in ("error", "critical")]
    assert [e["msg"] for e in errors] == ["start-up failed"], result.stderr
    return {"error": errors[0]["error"], "msgs": [line["msg"] for line in lines]}


def test_a_missing_model_path(tmp_path: Path, models: Path) -> None:
    failure = serve(tmp_path, models, model=f'target = "{tmp_path / "nowhere"}"')
    assert failure["error"].startswith(f"{tmp_path / 'nowhere'}: no such file or folder")
    assert failure["msgs"][-2:] == ["loading target", "start-up failed"]


def test_an_unknown_model_name_lists_the_known_ones(tmp_path: Path, models: Path) -> None:
    failure = serve(tmp_path, models, model='target = "smollm3-nonesuch"')
    assert failure["error"] == (
        "smollm3-nonesuch: no such file or folder, and not a known model name "
        f"(known: {', '.join(known_models())})")


def test_an_incompatible_draft(tmp_path: Path, models: Path) -> None:
    model = f'target = "{models / "target"}"\ndraft = "{models / "other-vocab"}"'
    failure = serve(tmp_path, models, model=model)
    assert failure["error"].startswith("draft vocabulary (300 tokens")
    assert failure["msgs"][-3:] == ["loading target", "loading draft", "start-up failed"]


def test_a_taken_metrics_port_fails_before_any_model_loads(
    tmp_path: Path, models: Path, taken_port: int
) -> None:
    failure = serve(tmp_path, models,
                    server=f"port = {free_port()}\nmetrics_port = {taken_port}")
    assert failure["error"] == f"metrics port {taken_port} on 127.0.0.1: Address already in use"
    assert not [msg for msg in failure["msgs"] if msg.startswith("loading")]


def test_a_taken_grpc_port_fails_before_any_model_loads(
    tmp_path: Path, models: Path, taken_port: int
) -> None:
    failure = serve(tmp_path, models, server=f"port = {taken_port}")
    assert failure["error"] == f"gRPC port {taken_port} on 127.0.0.1: Address already in use"
    assert failure["msgs"] == ["starting", "start-up failed"]


def test_a_second_daemon_on_the_same_port_exits(tmp_path: Path, models: Path) -> None:
    """gRPC's default SO_REUSEPORT would let both bind and split the traffic."""
    first = Daemon(tmp_path)
    try:
        first.wait_serving()
        failure = serve(tmp_path, models, server=f"port = {first.port}")
        assert failure["error"] == (
            f"gRPC port {first.port} on 127.0.0.1: Address already in use")
        assert first.health() == 1  # SERVING, untouched
    finally:
        assert first.stop() == 0


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "server.tls_cert: cannot read {cert}: No such file or directory"),
        ({"cert": "not a certificate\n", "key": "nor a key\n"},
         "server.tls_cert {cert} and server.tls_key {key} are not a PEM certificate and its "
         "private key: "),
    ],
)
def test_bad_tls_files(
    tmp_path: Path, models: Path, files: dict[str, str], message: str
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    for name, text in files.items():
        (tmp_path / f"{name}.pem").write_text(text)
    failure = serve(tmp_path, models, server=f'port = {free_port()}\ntls_cert = "{cert}"\n'
                                             f'tls_key = "{key}"')
    assert failure["error"].startswith(message.format(cert=cert, key=key))
    assert failure["msgs"] == ["starting", "start-up failed"]


@pytest.mark.asyncio
async def test_a_bug_while_starting_exits_1_and_keeps_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception no start-up failure explains (here a ValueError out of
    building the engine) still ends serve with status 1 and one error line,
    and that line carries the traceback."""
    import logging

    from specpage.config import Config, ServerSection
    from specpage.serve import daemon

    def broken(config: Config) -> None:
        raise ValueError("a bug in building the engine")

    monkeypatch.setattr(daemon, "build_engine", broken)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("specpage.serve.daemon")
    logger.addHandler(handler)
    try:
        status = await daemon.serve(Config(server=ServerSection(host="127.0.0.1", port=0)))
    finally:
        logger.removeHandler(handler)
    assert status == 1
    [error] = [r for r in records if r.levelno >= logging.ERROR]
    assert error.getMessage() == "start-up failed"
    assert error.error == "a bug in building the engine"  # type: ignore[attr-defined]
    assert error.exc_info is not None and error.exc_info[0] is ValueError
