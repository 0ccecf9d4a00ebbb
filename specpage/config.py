"""The daemon's configuration: typed, frozen sections and the one place that reads them.

Layers, later wins: defaults < TOML file < ``SPECPAGE_<SECTION>_<FIELD>`` environment
variables < CLI overrides (``{"server.port": 6000}``). Unknown keys are errors that
name the key and where it came from. This is the only module that reads config
files and the environment for configuration.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from specpage.core.config_error import ConfigError
from specpage.core.config_error import require as _require
from specpage.core.engine_config import EngineConfig
from specpage.models.quant_names import Q8_REFUSED, QUANTIZATIONS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
ENV_PREFIX = "SPECPAGE_"
# Printed as a comment by dump_toml(show_secrets=False), so output can be shared.
SECRET_KEYS = frozenset({("server", "bearer_token")})


class ModelSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    target: str = "smollm2-135m"  # HF folder, .gguf file or a known model name
    draft: str | None = None  # None: no draft model (the proposers that need none still run)
    # auto: bf16 on CUDA and on a CPU with AVX-512 BF16 or AMX, else fp32
    # (loader.auto_dtype); None: the loader's default, fp32 on CPU.
    dtype: str | None = "auto"
    device: str = "cpu"
    # Both models' linears (models/quant_names); auto: q4 where a model is a
    # Q4_0/Q4_1 GGUF, reusing its blocks (the default target's), else as
    # loaded; "none" keeps the exact path LLM() and `specpage generate` take.
    quantization: str = "auto"

    def __post_init__(self) -> None:
        # An empty name would surface much later as a puzzling model-loading error.
        for name in ("target", "draft", "dtype", "device"):
            _require(getattr(self, name) != "", f"model.{name} must not be empty", "")
        _require(self.quantization in QUANTIZATIONS and self.quantization != "q8",
                 Q8_REFUSED if self.quantization == "q8" else
                 f"model.quantization must be one of {', '.join(QUANTIZATIONS)}",
                 self.quantization)


class ServerSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port
    max_queue: int = 256  # admission queue bound; beyond it RESOURCE_EXHAUSTED
    max_message_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int = 4096  # x submission.PROMPT_BYTES_PER_TOKEN bounds text, untokenized
    drain_grace_s: float = 30.0
    tls_cert: str | None = None
    tls_key: str | None = None
    bearer_token: str | None = None
    bearer_token_file: str | None = None  # e.g. a systemd credential, %d/bearer-token
    metrics_port: int | None = None  # None: no metrics endpoint
    metrics_host: str = "127.0.0.1"
    http_port: int | None = None  # the OpenAI-compatible HTTP API; None: off
    http_host: str = "127.0.0.1"
    # The names the HTTP API answers to as `model`, comma-separated (vLLM's
    # --served-model-name); None: model.target and the checkpoint's Hugging
    # Face id where its metadata has one.
    served_model_name: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "server.port must be in 0..65535", self.port)
        if self.metrics_port is not None:
            port = self.metrics_port
            _require(0 <= port <= 65535, "server.metrics_port must be in 0..65535", port)
            _require(
                port == 0 or port != self.port, "server.metrics_port must differ from port", port
            )
        if self.http_port is not None:
            port = self.http_port
            _require(0 <= port <= 65535, "server.http_port must be in 0..65535", port)
            _require(port == 0 or port not in (self.port, self.metrics_port),
                     "server.http_port must differ from port and metrics_port", port)
        for name in ("max_queue", "max_message_bytes", "max_prompt_tokens"):
            _require(getattr(self, name) > 0, f"server.{name} must be > 0", getattr(self, name))
        if self.served_model_name is not None:
            _require(all(self.served_model_names), "server.served_model_name: names must "
                     "not be empty", self.served_model_name)
        _require(self.drain_grace_s >= 0, "server.drain_grace_s must be >= 0", self.drain_grace_s)
        _require(
            self.log_level in LOG_LEVELS,
            f"server.log_level must be one of {', '.join(LOG_LEVELS)}",
            self.log_level,
        )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("server.tls_cert and server.tls_key go together: set both or none")
        # An empty token would let any client that sends "Bearer " in.
        _require(self.bearer_token != "", "server.bearer_token must not be empty", "")
        if self.bearer_token is not None and self.bearer_token_file is not None:
            raise ConfigError("set server.bearer_token or server.bearer_token_file, not both")
        hosts = [("host", self.host)]
        if self.http_port is not None:
            hosts.append(("http_host", self.http_host))
        for name, host in hosts:
            if not is_loopback(host) and not self.tls and not self.has_token:
                raise ConfigError(
                    f"server.{name} {host!r} is not a loopback address: anything reachable "
                    "from other machines needs TLS (tls_cert, tls_key) or a bearer token "
                    "(bearer_token or bearer_token_file); the default binds 127.0.0.1 only"
                )

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def has_token(self) -> bool:
        return self.bearer_token is not None or self.bearer_token_file is not None

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The names served_model_name sets; empty when it is unset."""
        if self.served_model_name is None:
            return ()
        return tuple(name.strip() for name in self.served_model_name.split(","))


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    server: ServerSection = msgspec.field(default_factory=ServerSection)


SECTIONS: dict[str, type[msgspec.Struct]] = {
    "model": ModelSection,
    "engine": EngineConfig,
    "server": ServerSection,
}

Values = dict[tuple[str, str], Any]  # (section, field) -> value of the field's type


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] = os.environ,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Defaults < TOML file at path < SPECPAGE_* variables in env < dotted-key overrides."""
    values: Values = {}
    if path is not None:
        values |= _file_values(Path(path))
    values |= _env_values(env)
    values |= _override_values(overrides or {})
    sections: dict[str, Any] = {
        name: cls(**{field: value for (sec, field), value in values.items() if sec == name})
        for name, cls in SECTIONS.items()
    }
    config = Config(**sections)
    read_bearer_token(config.server)  # fail at startup, not at the first request
    return config


def read_bearer_token(server: ServerSection) -> str | None:
    """The bearer token, from the config or from bearer_token_file (stripped)."""
    if server.bearer_token_file is None:
        return server.bearer_token
    try:
        token = Path(server.bearer_token_file).read_text().strip()
    except OSError as error:
        raise ConfigError(
            f"server.bearer_token_file: cannot read {server.bearer_token_file}: {error.strerror}"
        ) from None
    if not token:
        raise ConfigError(f"server.bearer_token_file: {server.bearer_token_file} is empty")
    return token


def parse_override(text: str) -> tuple[str, str]:
    """``"server.port=6000"`` -> ``("server.port", "6000")``, for ``--set``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"expected section.key=value, got {text!r}")
    return key.strip(), value


def dump_toml(config: Config, *, show_secrets: bool = True) -> str:
    """The config as TOML that load_config reads back into an equal Config.

    None values are omitted, since None is every optional field's default.
    """
    lines: list[str] = []
    for name in SECTIONS:
        section = getattr(config, name)
        if lines:
            lines.append("")
        lines.append(f"[{name}]")
        for field in msgspec.structs.fields(section):
            value = getattr(section, field.name)
            if value is None:
                continue
            if (name, field.name) in SECRET_KEYS and not show_secrets:
                lines.append(f"# {field.name} is set (hidden)")
                continue
            lines.append(f"{field.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def _file_values(path: Path) -> Values:
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    values: Values = {}
    for name, table in data.items():
        if name not in SECTIONS:
            raise ConfigError(f"{path}: unknown section {name!r}")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {name!r} must be a table ([{name}])")
        for field, value in table.items():
            # Strict: TOML is typed, so port = "6000" is a mistake worth naming.
            values[name, field] = _convert(name, field, value, str(path), strict=True)
    return values


def _env_values(env: Mapping[str, str]) -> Values:
    values: Values = {}
    for variable, value in env.items():
        if not variable.startswith(ENV_PREFIX):
            continue
        section, _, field = variable.removeprefix(ENV_PREFIX).partition("_")
        # Others, like SPECPAGE_CACHE_DIR, are not config and belong to their readers.
        if section.lower() not in SECTIONS or section != section.upper():
            continue
        if field != field.upper():
            raise ConfigError(f"${variable}: unknown key '{section.lower()}.{field}'")
        values[section.lower(), field.lower()] = _convert(
            section.lower(), field.lower(), value, f"${variable}", strict=False
        )
    return values


def _override_values(overrides: Mapping[str, object]) -> Values:
    values: Values = {}
    for key, value in overrides.items():
        section, sep, field = key.partition(".")
        if not sep or section not in SECTIONS:
            raise ConfigError(f"override: unknown key {key!r} (expected section.key)")
        values[section, field] = _convert(section, field, value, "override", strict=False)
    return values


def _convert(section: str, field: str, value: object, source: str, *, strict: bool) -> Any:
    fields = {f.name: f for f in msgspec.structs.fields(SECTIONS[section])}
    if field not in fields:
        raise ConfigError(f"{source}: unknown key '{section}.{field}'")
    kind = fields[field].type
    # Text layers have no null; an empty value means None where None is allowed.
    if not strict and value == "" and _optional(kind):
        return None
    try:
        return msgspec.convert(value, kind, strict=strict)
    except msgspec.ValidationError as error:
        raise ConfigError(f"{source}: '{section}.{field}': {error}") from None


def _optional(kind: Any) -> bool:
    return type(None) in getattr(kind, "__args__", ())


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _toml_string(text: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    out = []
    for char in text:
        if char in escapes:
            out.append(escapes[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:  # TOML forbids raw control characters
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
