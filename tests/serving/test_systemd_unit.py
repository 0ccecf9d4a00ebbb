"""systemd/specpage.service: `systemd-analyze verify` finds nothing to say about it, and
the README's steps give it models it can read."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specpage.config import ServerSection, load_config
from specpage.models import fetch

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "specpage.service"
EXAMPLE = ROOT / "systemd" / "specpage.toml.example"
INSTALLED_BINARY = "/opt/specpage/.venv/bin/specpage"
SYSTEM_CACHE = "/var/cache"  # what %C means in a system unit

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed"
)


def verify(text: str, tmp_path: Path) -> list[str]:
    """Lines of verify's output that are about the unit itself.

    verify checks that ExecStart's binary exists, and /opt/specpage is only there
    on an installed machine, so a copy points ExecStart at this interpreter; the
    rest of the unit is checked as written.
    """
    assert f"ExecStart={INSTALLED_BINARY} " in text
    unit = tmp_path / "specpage.service"
    unit.write_text(text.replace(f"ExecStart={INSTALLED_BINARY} ", f"ExecStart={sys.executable} "))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Warnings about the host's own units (absent targets and the like) are not ours.
    output = (result.stdout + result.stderr).splitlines()
    ours = [line for line in output if "specpage.service" in line]
    if result.returncode != 0:
        assert ours, output  # a failure must be about our unit, not the host
    return ours


def service_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


@needs_systemd_analyze
def test_unit_verifies_without_warnings(tmp_path: Path) -> None:
    assert verify(UNIT.read_text(), tmp_path) == []


@needs_systemd_analyze
def test_verify_reports_a_misspelled_key(tmp_path: Path) -> None:
    # Guards the test above: unknown keys are only warnings, with exit status 0.
    text = UNIT.read_text().replace("ProtectClock=yes", "ProtectClok=yes")
    assert any("Unknown key 'ProtectClok'" in line for line in verify(text, tmp_path))


def test_unit_settings() -> None:
    settings = service_settings()
    assert settings["Type"] == ["notify"]
    assert settings["NotifyAccess"] == ["main"]
    assert settings["WatchdogSec"] == ["30"]
    assert "SPECPAGE_CACHE_DIR=%C/specpage" in settings["Environment"]
    # SIGKILL must not cut the drain short.
    assert int(settings["TimeoutStopSec"][0]) > ServerSection().drain_grace_s
    # Triton's JIT needs writable-then-executable memory.
    assert "MemoryDenyWriteExecute" not in settings
    assert settings["ExecStart"] == [
        f"{INSTALLED_BINARY} serve --config /etc/specpage/specpage.toml"
    ]


def test_the_example_config_speculates_without_a_model_and_names_the_packaged_draft() -> None:
    config = load_config(EXAMPLE, env={})
    assert (config.model.target, config.model.draft) == ("smollm2-135m", None)
    assert config.engine.model_free_methods == ("ngram", "suffix", "corpus")
    assert config.engine.spec_corpus == "auto"
    # The draft its commented line names needs no fetch: it is inside the
    # installed package.
    [named] = re.findall(r'^# draft = "([^"]+)"$', EXAMPLE.read_text(), re.MULTILINE)
    assert named in fetch.PACKAGED
    assert fetch.is_converted(fetch.packaged_model(named))


def test_readme_fetches_the_target_into_the_units_cache_directory() -> None:
    settings = service_settings()
    assert settings["CacheDirectory"] == ["specpage"]
    [cache] = [value.removeprefix("SPECPAGE_CACHE_DIR=") for value in settings["Environment"]
               if value.startswith("SPECPAGE_CACHE_DIR=")]
    cache = cache.replace("%C", SYSTEM_CACHE)
    readme = (ROOT / "README.md").read_text()
    steps = readme.split("### Under systemd", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    target = load_config(EXAMPLE, env={}).model.target
    fetch_step = f"SPECPAGE_CACHE_DIR={cache} {INSTALLED_BINARY} models fetch {target}"
    assert fetch_step in steps
    # Fetched before the service first starts, with the config it will read.
    lines = steps.splitlines()
    [fetch_line] = [i for i, line in enumerate(lines) if fetch_step in line]
    [start_line] = [i for i, line in enumerate(lines) if "enable --now specpage" in line]
    assert fetch_line < start_line
    assert any("systemd/specpage.toml.example /etc/specpage/specpage.toml" in line
               for line in lines[:start_line])
