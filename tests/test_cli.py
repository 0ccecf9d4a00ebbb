"""The command line: one name for the model on every command, and the
version the package was installed as."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from specpage.cli import build_parser


@pytest.mark.parametrize("flag", ["--model", "--target"])
def test_serve_takes_the_model_as_generate_does_and_target_still(flag: str) -> None:
    args = build_parser().parse_args(["serve", flag, "smollm2-135m"])
    assert args.target == "smollm2-135m"
    assert build_parser().parse_args(["generate", "hi", "--model", "x"]).model == "x"


def test_the_version_is_the_installed_package_s() -> None:
    import specpage

    assert specpage.__version__ == version("specpage")
    run = subprocess.run([sys.executable, "-m", "specpage", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"specpage {version('specpage')}"
