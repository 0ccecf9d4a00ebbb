"""lm-evaluation-harness against a real daemon: `lm_eval --model
local-completions` runs a tiny multiple-choice task made here (a YAML task
over a JSONL dataset) to its end, and its loglikelihoods, which come from
echo'd prompt log-probabilities, equal lm-eval's own `hf` backend on the same
fp32 checkpoint within 1e-4."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.checkpoints import tokenizer_pair
from tests.support.daemon import Daemon, http_daemon

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval[api]: its API models
TOLERANCE = 1e-4
TASK = "specpage_tiny_mc"
DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a small town"],
     "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "Water freezes at", "choices": [" zero degrees", " the sea", " noon"],
     "answer": 0},
]
YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    folder = tmp_path_factory.mktemp("lm-eval")
    tokenizer_pair(folder / "models")
    yield from http_daemon(folder)


def task_folder(root: Path) -> Path:
    folder = root / "tasks"
    folder.mkdir()
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / f"{TASK}.yaml").write_text(YAML.format(task=TASK, data=data))
    return folder


def lm_eval(root: Path, name: str, model: str, *args: str) -> dict[int, list[float]]:
    """Runs the task; doc id -> the loglikelihood of each choice."""
    out = root / name
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(root / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", "run", "--model", model, *args,
               "--tasks", TASK, "--include_path",
               str(root / "tasks"), "--output_path", str(out), "--log_samples",
               "--batch_size", "1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [samples] = out.rglob(f"samples_{TASK}_*.jsonl")
    found = {}
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        found[sample["doc_id"]] = [float(ll) for ll, _ in sample["filtered_resps"]]
    assert sorted(found) == list(range(len(DOCS)))
    return found


def test_local_completions_equal_the_hf_backend(daemon: Daemon, tmp_path: Path) -> None:
    task_folder(tmp_path)
    target = str(daemon.config.parent / "models" / "target")
    served = lm_eval(tmp_path, "served", "local-completions", "--model_args",
                     f"base_url={daemon.http_url}/v1/completions,model={target},"
                     f"tokenizer={target},tokenizer_backend=huggingface,num_concurrent=1,"
                     "max_retries=1,tokenized_requests=True")
    local = lm_eval(tmp_path, "hf", "hf", "--model_args", f"pretrained={target},dtype=float32",
                    "--device", "cpu")
    for doc_id, expected in local.items():
        assert served[doc_id] == pytest.approx(expected, abs=TOLERANCE), doc_id
