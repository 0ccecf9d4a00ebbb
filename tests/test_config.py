"""Config layers (file < env < CLI), errors that name the key, and the TOML round trip."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import msgspec
import pytest

from specpage.commands import config as config_command
from specpage.config import (
    Config,
    ConfigError,
    ModelSection,
    ServerSection,
    dump_toml,
    load_config,
    read_bearer_token,
)
from specpage.core.engine_config import EngineConfig

EXAMPLE = Path(__file__).resolve().parent.parent / "systemd" / "specpage.toml.example"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    config = load_config(None, env={})
    assert config == Config()
    assert config.model.target == "smollm2-135m"
    assert config.model.draft is None
    assert config.engine.spec_k == 4
    assert (config.server.host, config.server.port) == ("127.0.0.1", 50051)
    assert config.server.metrics_port is None


def test_precedence_file_env_cli(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[server]\nport = 5000\nmax_queue = 10\nlog_level = "debug"\n'
        '[engine]\nspec_k = 2\nblock_size = 32\n[model]\ndraft = "/models/draft"\n',
    )
    env = {
        "SPECPAGE_SERVER_PORT": "6000",
        "SPECPAGE_SERVER_MAX_QUEUE": "20",
        "SPECPAGE_ENGINE_SPEC_K": "0",
        "SPECPAGE_ENGINE_ADAPTIVE_K": "false",
        "SPECPAGE_SERVER_DRAIN_GRACE_S": "5",
        "SPECPAGE_MODEL_DRAFT": "",  # empty: None, no speculation
        "SPECPAGE_CACHE_DIR": "/cache",  # not config: ignored here
        "HOME": "/root",
    }
    overrides = {"server.port": 7000, "server.metrics_port": "9400"}
    config = load_config(path, env=env, overrides=overrides)
    assert config.server.port == 7000  # CLI over env over file
    assert config.server.max_queue == 20  # env over file
    assert config.server.log_level == "debug"  # file only
    assert config.server.drain_grace_s == 5.0
    assert config.server.metrics_port == 9400
    assert config.engine.spec_k == 0
    assert config.engine.adaptive_k is False
    assert config.engine.block_size == 32
    assert config.engine.num_blocks == 4096  # default
    assert config.model.draft is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nprot = 1\n", "unknown key 'server.prot'"),
        ("[srever]\nport = 1\n", "unknown section 'srever'"),
        ("port = 1\n", "unknown section 'port'"),
        ("[server]\nport = '6000'\n", "'server.port': Expected `int`, got `str`"),
        ("[engine]\nadaptive_k = 1\n", "'engine.adaptive_k': Expected `bool`, got `int`"),
        ("[server\n", "invalid TOML"),
    ],
)
def test_file_errors_name_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + ".*" + re.escape(message)):
        load_config(path, env={})


def test_empty_bearer_token_in_file_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nbearer_token = ""\n')
    with pytest.raises(ConfigError, match="server.bearer_token must not be empty"):
        load_config(path, env={})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="absent.toml: cannot read"):
        load_config(tmp_path / "absent.toml", env={})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SPECPAGE_SERVER_PROT": "1"}, "$SPECPAGE_SERVER_PROT: unknown key 'server.prot'"),
        ({"SPECPAGE_ENGINE_": "1"}, "$SPECPAGE_ENGINE_: unknown key 'engine.'"),
        ({"SPECPAGE_SERVER_port": "1"}, "$SPECPAGE_SERVER_port: unknown key 'server.port'"),
        (
            {"SPECPAGE_SERVER_PORT": "sixty"},
            "$SPECPAGE_SERVER_PORT: 'server.port': Expected `int`, got `str`",
        ),
        (
            {"SPECPAGE_ENGINE_ADAPTIVE_K": "maybe"},
            "$SPECPAGE_ENGINE_ADAPTIVE_K: 'engine.adaptive_k': Expected `bool`",
        ),
    ],
)
def test_env_errors_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, env=env)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"server.prot": 1}, "override: unknown key 'server.prot'"),
        ({"port": 1}, "override: unknown key 'port'"),
        ({"srever.port": 1}, "override: unknown key 'srever.port'"),
        ({"engine.spec_k": "many"}, "override: 'engine.spec_k': Expected `int`, got `str`"),
        ({"engine.spec_ngram_max": 33}, "engine.spec_ngram_max must be at most 32, got 33"),
    ],
)
def test_override_errors_name_the_key(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, env={}, overrides=overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"server.port": 70000}, "server.port must be in 0..65535, got 70000"),
        ({"server.metrics_port": -1}, "server.metrics_port must be in 0..65535, got -1"),
        ({"server.metrics_port": 50051}, "server.metrics_port must differ from port"),
        ({"server.http_port": 65536}, "server.http_port must be in 0..65535, got 65536"),
        ({"server.http_port": 50051}, "server.http_port must differ from port and metrics_port"),
        ({"server.http_port": 9100, "server.metrics_port": 9100},
         "server.http_port must differ from port and metrics_port"),
        ({"server.max_queue": 0}, "server.max_queue must be > 0, got 0"),
        ({"server.drain_grace_s": -1}, "server.drain_grace_s must be >= 0"),
        ({"server.log_level": "loud"}, "server.log_level must be one of"),
        ({"engine.block_size": 0}, "engine.block_size must be > 0, got 0"),
        ({"engine.num_blocks": -4}, "engine.num_blocks must be > 0, got -4"),
        ({"engine.spec_k": -1}, "engine.spec_k must be >= 0, got -1"),
        ({"engine.spec_k": 8, "engine.max_step_tokens": 9},
         "engine.max_step_tokens must be >= spec_k + 2 (10), got 9"),
        ({"engine.admission_watermark": 1.0}, "engine.admission_watermark must be in [0, 1)"),
        ({"model.target": ""}, "model.target must not be empty"),
        ({"model.draft": "/d", "model.device": ""}, "model.device must not be empty"),
        ({"server.tls_cert": "/c.pem"}, "tls_cert and server.tls_key go together"),
        ({"server.tls_key": "/k.pem"}, "tls_cert and server.tls_key go together"),
        (
            {"server.bearer_token": "t", "server.bearer_token_file": "/t"},
            "server.bearer_token or server.bearer_token_file, not both",
        ),
    ],
)
def test_invalid_values(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, env={}, overrides=overrides)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
def test_non_local_bind_needs_tls_or_token(host: str) -> None:
    with pytest.raises(ConfigError, match="not a loopback address.*needs TLS"):
        load_config(None, env={}, overrides={"server.host": host})
    with pytest.raises(ConfigError, match="not a loopback address"):
        ServerSection(host=host)
    assert ServerSection(host=host, tls_cert="/c.pem", tls_key="/k.pem").tls
    assert ServerSection(host=host, bearer_token="secret").has_token


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_a_non_local_http_front_needs_tls_or_token(host: str) -> None:
    with pytest.raises(ConfigError, match="http_host.*not a loopback address.*needs TLS"):
        load_config(None, env={}, overrides={"server.http_port": 8000, "server.http_host": host})
    assert ServerSection(http_port=8000, http_host=host, bearer_token="secret").has_token
    assert ServerSection(http_host=host).http_port is None  # off: its host binds nothing


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost"])
def test_loopback_bind_needs_nothing(host: str) -> None:
    assert ServerSection(host=host).host == host


def test_bearer_token_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    env = {"SPECPAGE_SERVER_HOST": "0.0.0.0", "SPECPAGE_SERVER_BEARER_TOKEN_FILE": str(token)}
    config = load_config(None, env=env)
    assert read_bearer_token(config.server) == "s3cret"
    token.write_text("\n")
    with pytest.raises(ConfigError, match="bearer_token_file: .* is empty"):
        load_config(None, env=env)
    token.unlink()
    with pytest.raises(ConfigError, match="bearer_token_file: cannot read"):
        load_config(None, env=env)


def full_config() -> Config:
    return Config(
        model=ModelSection(target="/models/t", draft="/models/d", dtype="bf16", device="cuda:1"),
        engine=EngineConfig(block_size=32, num_blocks=100, spec_k=0, adaptive_k=False),
        server=ServerSection(
            host="::",
            port=6000,
            drain_grace_s=2.5,
            tls_cert="/etc/c.pem",
            tls_key="/etc/k.pem",
            bearer_token='quote " backslash \\ tab \t newline \n del \x7f é',
            metrics_port=9400,
            metrics_host="0.0.0.0",
            log_level="warning",
        ),
    )


@pytest.mark.parametrize("config", [Config(), full_config()], ids=["defaults", "full"])
def test_toml_round_trip(tmp_path: Path, config: Config) -> None:
    path = write(tmp_path, dump_toml(config))
    assert load_config(path, env={}) == config


def test_dump_toml_text() -> None:
    text = dump_toml(Config())
    assert text.startswith('[model]\ntarget = "smollm2-135m"\ndtype = "auto"\ndevice = "cpu"\n'
                           'quantization = "auto"\n\n[engine]\n')
    assert "drain_grace_s = 30.0\n" in text
    assert "adaptive_k = true\n" in text
    assert "draft" not in text  # None: omitted


def test_dump_toml_hides_secrets_on_request() -> None:
    config = full_config()
    text = dump_toml(config, show_secrets=False)
    assert "bearer_token =" not in text
    assert "# bearer_token is set (hidden)" in text


def test_example_lists_every_key_and_loads() -> None:
    text = EXAMPLE.read_text()
    for name in ("model", "engine", "server"):
        assert f"[{name}]" in text
        section = getattr(Config(), name)
        for field in msgspec.structs.fields(section):
            assert re.search(rf"^# {field.name} = ", text, re.MULTILINE), field.name
    assert load_config(EXAMPLE, env={}) == Config()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The command reads the process environment: start it without SPECPAGE_* variables."""
    for variable in [v for v in os.environ if v.startswith("SPECPAGE_")]:
        monkeypatch.delenv(variable)
    return monkeypatch


def run_config_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser()
    config_command.add_parser(parser.add_subparsers(), "config")
    args = parser.parse_args(["config", *argv])
    assert args.run(args) == 0
    return capsys.readouterr().out


def test_config_print_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "[server]\nport = 5000\nbearer_token = 'zq-secret'\n")
    clean_env.setenv("SPECPAGE_ENGINE_SPEC_K", "3")
    argv = ["--print", "--config", str(path), "--set", "server.port=6000"]
    argv += ["--set", "model.draft=/d"]
    out = run_config_command(argv, capsys)
    assert "port = 6000\n" in out
    assert "spec_k = 3\n" in out
    assert 'draft = "/d"\n' in out
    assert "zq-secret" not in out
    assert "# bearer_token is set (hidden)" in out
    assert 'bearer_token = "zq-secret"\n' in run_config_command([*argv, "--show-secrets"], capsys)
    printed = write(tmp_path, run_config_command([*argv, "--show-secrets"], capsys))
    overrides = {"server.port": 6000, "model.draft": "/d"}
    expected = load_config(path, env={"SPECPAGE_ENGINE_SPEC_K": "3"}, overrides=overrides)
    assert load_config(printed, env={}) == expected


@pytest.mark.usefixtures("clean_env")
def test_config_command_without_print_only_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_config_command([], capsys) == ""
    with pytest.raises(ConfigError, match="expected section.key=value"):
        run_config_command(["--set", "server.port"], capsys)
    with pytest.raises(ConfigError, match="override: unknown key 'server.prot'"):
        run_config_command(["--set", "server.prot=1"], capsys)


def test_every_engine_setting_is_one_field_of_the_engines_own_config() -> None:
    """The [engine] section is the type Engine takes, so a scheduler knob
    such as the admission watermark reaches it from any config layer."""
    config = load_config(env={"SPECPAGE_ENGINE_ADMISSION_WATERMARK": "0.1"},
                         overrides={"engine.max_num_seqs": 8})
    assert type(config.engine) is EngineConfig
    assert config.engine == EngineConfig(max_num_seqs=8, admission_watermark=0.1)
    assert Config().engine == EngineConfig()
