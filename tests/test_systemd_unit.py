"""systemd/specpage.service: `systemd-analyze verify` finds nothing to say about it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specpage.config import ServerSection

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "specpage.service"
INSTALLED_BINARY = "/opt/specpage/.venv/bin/specpage"

pytestmark = pytest.mark.skipif(
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


def test_unit_verifies_without_warnings(tmp_path: Path) -> None:
    assert verify(UNIT.read_text(), tmp_path) == []


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
