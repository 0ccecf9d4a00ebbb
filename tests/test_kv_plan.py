"""`specpage kv-plan` prices each model's KV in the dtype the daemon runs it in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpage.cli import main
from specpage.config import ModelSection
from specpage.kernels.cpu import features as cpu
from specpage.models.loader import load_model
from tests.support.checkpoints import tiny_checkpoint


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, int]:
    assert main(["kv-plan", "--lengths", "16", "--json", *argv]) == 0
    per_token: dict[str, int] = json.loads(capsys.readouterr().out)["kv_bytes_per_token"]
    return per_token


def test_the_draft_is_priced_in_the_dtype_the_daemon_loads_it_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    draft = tmp_path / "draft"
    tiny_checkpoint(draft, num_hidden_layers=1)  # 2 KV heads of 16
    config = json.loads((draft / "config.json").read_text())
    # Saved in fp16: the daemon runs it in its own dtype all the same (bf16 on
    # a CPU with native bf16 products, else fp32), and so keeps its KV.
    (draft / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    loaded = load_model(draft, ModelSection().dtype)  # as the daemon does by default

    got = plan(capsys, "--draft", str(draft))

    itemsize = next(loaded.model.parameters()).dtype.itemsize
    assert itemsize == (2 if cpu.has_fast_bf16() else 4)
    assert got == {"draft": 2 * 1 * 2 * 16 * itemsize, "sum": 2 * 1 * 2 * 16 * itemsize}
    assert plan(capsys, "--draft", str(draft), "--device", "cuda")["draft"] == 128  # bf16
    assert plan(capsys, "--draft", str(draft), "--dtype", "fp16")["draft"] == 128
