"""Triton is needed only where tensors are on CUDA: on a CPU machine without
it, the daemon imports, a forward runs and a daemon serves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specpage.client import Client
from specpage.core.request import SamplingParams
from specpage.llm import LLM
from tests.support.checkpoints import tiny_checkpoint
from tests.support.daemon import REPO, Daemon

PROMPT = [5, 17, 42, 9, 100, 3]
PARAMS = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}

SCRIPT = """
import json, sys
from tests.support.no_triton import hide_triton
hide_triton()
import specpage.serve.daemon, specpage.llm
from specpage.core.request import SamplingParams
from specpage.engine import EngineConfig
llm = specpage.llm.LLM(sys.argv[1], sys.argv[2], EngineConfig(block_size=4, num_blocks=64))
[done] = llm.generate([json.loads(sys.argv[3])], SamplingParams(**json.loads(sys.argv[4])))
print(json.dumps({"tokens": done.samples[0].token_ids,
                  "triton": sorted(n for n in sys.modules if n.split(".")[0] == "triton")}))
"""


def test_the_daemon_imports_and_a_cpu_forward_runs_without_triton(tmp_path: Path) -> None:
    tiny_checkpoint(tmp_path / "target")
    tiny_checkpoint(tmp_path / "draft", seed=1, num_hidden_layers=1)
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "target"), str(tmp_path / "draft"),
         json.dumps(PROMPT), json.dumps(PARAMS)],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["triton"] == []
    from specpage.engine import EngineConfig

    here = LLM(tmp_path / "target", tmp_path / "draft", EngineConfig(block_size=4, num_blocks=64))
    [done] = here.generate([PROMPT], SamplingParams(**PARAMS))
    assert result["tokens"] == done.samples[0].token_ids and len(done.samples[0].token_ids) == 8


@pytest.mark.asyncio
async def test_a_daemon_serves_without_triton(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, without_triton=True)
    daemon.wait_serving()
    try:
        async with Client(daemon.address) as client:
            completion = await client.complete(PROMPT, **PARAMS)
        assert len(completion.samples[0].token_ids) == 8
        assert completion.samples[0].finish_reason == "length"
    finally:
        assert daemon.stop() == 0
    assert "triton" not in daemon.log.read_text().lower()
