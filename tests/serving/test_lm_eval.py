"""lm-evaluation-harness against a real daemon: `lm_eval --model
local-completions` runs a tiny multiple-choice task made here (a YAML task
over a JSONL dataset) to its end, and its loglikelihoods, which come from
echo'd prompt log-probabilities, equal lm-eval's own `hf` backend on the same
fp32 checkpoint within 1e-4. `lm_eval --model local-chat-completions
--apply_chat_template` runs a tiny generate_until task to its end, and each
greedy answer it logs is what the openai SDK's chat completion returns for
the same messages, stop and max_tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.serving.test_openai_api import TIMEOUT_S
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
GEN_TASK = "specpage_tiny_gen"
GEN_DOCS = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "Tell me a story.", "answer": "Once"},
    {"question": "Hello there", "answer": "Hello"},
]
MAX_GEN_TOKENS = 8
STOP = "."  # lm-eval's `until`: the daemon stops at it and leaves it out
GEN_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["{stop}"]
  max_gen_toks: {max_tokens}
  temperature: 0
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    folder = tmp_path_factory.mktemp("lm-eval")
    tokenizer_pair(folder / "models")
    yield from http_daemon(folder)


def task_folder(root: Path) -> Path:
    """Both tasks and their datasets, in the folder given to --include_path."""
    folder = root / "tasks"
    folder.mkdir()
    for task, docs, yaml in ((TASK, DOCS, YAML), (GEN_TASK, GEN_DOCS, GEN_YAML)):
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (folder / f"{task}.yaml").write_text(
            yaml.format(task=task, data=data, stop=STOP, max_tokens=MAX_GEN_TOKENS))
    return folder


def run_lm_eval(root: Path, name: str, task: str, model: str,
                *args: str) -> dict[int, dict[str, Any]]:
    """Runs the task to its end; doc id -> its logged sample."""
    out = root / name
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(root / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", "run", "--model", model, *args,
               "--tasks", task, "--include_path",
               str(root / "tasks"), "--output_path", str(out), "--log_samples",
               "--batch_size", "1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [results] = out.rglob("results_*.json")
    assert task in json.loads(results.read_text())["results"]
    [samples] = out.rglob(f"samples_{task}_*.jsonl")
    found = {}
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        found[sample["doc_id"]] = sample
    return found


def lm_eval(root: Path, name: str, model: str, *args: str) -> dict[int, list[float]]:
    """Runs the multiple-choice task; doc id -> the loglikelihood of each choice."""
    found = run_lm_eval(root, name, TASK, model, *args)
    assert sorted(found) == list(range(len(DOCS)))
    return {doc_id: [float(ll) for ll, _ in sample["filtered_resps"]]
            for doc_id, sample in found.items()}


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


def test_local_chat_completions_answer_as_the_sdk(daemon: Daemon, tmp_path: Path) -> None:
    task_folder(tmp_path)
    target = str(daemon.config.parent / "models" / "target")
    found = run_lm_eval(tmp_path, "chat", GEN_TASK, "local-chat-completions", "--model_args",
                        f"base_url={daemon.http_url}/v1/chat/completions,model={target},"
                        "num_concurrent=1,max_retries=1", "--apply_chat_template")
    assert sorted(found) == list(range(len(GEN_DOCS)))
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as sdk:
        for doc_id, doc in enumerate(GEN_DOCS):
            [sent] = found[doc_id]["arguments"]["gen_args_0"]["arg_0"]  # the messages' JSON
            messages = json.loads(sent)
            assert messages == [{"role": "user", "content": doc["question"]}]
            reply = sdk.chat.completions.create(model=target, messages=messages, temperature=0,
                                                max_tokens=MAX_GEN_TOKENS, stop=[STOP])
            assert reply.choices[0].message.content is not None
            assert found[doc_id]["filtered_resps"] == [reply.choices[0].message.content], doc_id
