"""The error every configuration check raises, and the check itself."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is unknown, mistyped or inconsistent; the message says which."""


def require(ok: bool, message: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"{message}, got {value!r}")
