"""lm-evaluation-harness's score of SmolLM2-135M-Instruct served by specpage,
in fp32 and in q4, on a small multiple-choice set.

    python bench/lm_eval_mc.py [--quick]

The questions: bench/workloads/mc.jsonl (40 short general-knowledge,
commonsense and arithmetic questions with 2-4 choices and the answer's
index, written for this bench; --quick takes the first 10). Each is asked as
"Question: ...\\nAnswer:" and every choice is scored by its loglikelihood.

The systems are daemons started as `make serve` does, one up at a time, no
draft: `fp32` (--quantization none, model.dtype float32: the fp32 folder
`smollm2-135m` resolves to, itself the dequantized Q4_1 GGUF) and `q4` (the
default: the GGUF's Q4_1 blocks with bf16 activations and a Q8_0 vocabulary
projection). Against each, `lm_eval --model local-completions` sends the
tokenized prompts with echo to /v1/completions, one request at a time, and
logs its samples. Reported: acc and acc_norm of each, and between the two the
mean and largest absolute difference of the per-choice loglikelihoods and
the questions whose predicted answers (the likeliest choice) differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish, machine, parse_args  # noqa: E402
from bench.serving import MODEL, SPECPAGE, Running, ServerSpec, free_port  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

QUESTIONS = Path(__file__).resolve().parent / "workloads" / "mc.jsonl"
QUICK_QUESTIONS = 10
TASK = "specpage_bench_mc"
LM_EVAL_TIMEOUT_S = 3600.0  # 40 questions x 3 choices on 2 busy cores took minutes
SYSTEMS = {
    "fp32": ["--quantization", "none", "--set", "model.dtype=float32"],
    "q4": [],
}
YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def task_folder(root: Path, count: int | None) -> list[dict[str, Any]]:
    """Writes the task's YAML and its questions under root; returns them."""
    lines = [line for line in QUESTIONS.read_text().splitlines() if line.strip()]
    docs = [json.loads(line) for line in lines][:count]
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (root / f"{TASK}.yaml").write_text(YAML.format(task=TASK, data=data))
    return docs


def daemon(name: str, threads: int) -> ServerSpec:
    http = free_port()
    argv = [str(SPECPAGE), "serve", "--target", MODEL, "--draft", "", *SYSTEMS[name],
            "--port", "0", "--http-port", str(http), "--set", "server.log_level=warning"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    return ServerSpec(name, argv, env, http)


def lm_eval(url: str, root: Path, out: Path) -> dict[int, dict[str, Any]]:
    """Runs the task against url; doc id -> its logged sample."""
    tokenizer = ensure_model(MODEL)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(root / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
               "--model_args",
               f"base_url={url}/v1/completions,model={MODEL},tokenizer={tokenizer},"
               "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,"
               "tokenized_requests=True",
               "--tasks", TASK, "--include_path", str(root), "--output_path", str(out),
               "--log_samples", "--batch_size", "1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=LM_EVAL_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval exited {done.returncode}: {done.stderr[-3000:]}")
    [samples] = out.rglob(f"samples_{TASK}_*.jsonl")
    found = {}
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        found[sample["doc_id"]] = sample
    return found


def choice_lls(sample: dict[str, Any]) -> list[float]:
    return [float(ll) for ll, _ in sample["filtered_resps"]]


def predicted(sample: dict[str, Any]) -> int:
    lls = choice_lls(sample)
    return lls.index(max(lls))


def accuracy(samples: dict[int, dict[str, Any]]) -> dict[str, float]:
    metrics = [m for m in ("acc", "acc_norm") if m in samples[0]]
    return {m: sum(float(s[m]) for s in samples.values()) / len(samples) for m in metrics}


def compare(docs: list[dict[str, Any]], fp32: dict[int, dict[str, Any]],
            q4: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """fp32 against q4: per-choice loglikelihood differences and changed answers."""
    differences = [abs(a - b) for i in range(len(docs))
                   for a, b in zip(choice_lls(fp32[i]), choice_lls(q4[i]), strict=True)]
    changed = [{"doc_id": i, "question": docs[i]["question"], "answer": docs[i]["answer"],
                "fp32": predicted(fp32[i]), "q4": predicted(q4[i])}
               for i in range(len(docs)) if predicted(fp32[i]) != predicted(q4[i])]
    return {"loglikelihood_abs_diff_mean": sum(differences) / len(differences),
            "loglikelihood_abs_diff_max": max(differences), "choices": len(differences),
            "answers_differ": len(changed), "differing": changed}


def main() -> None:
    args = parse_args(__doc__)
    samples: dict[str, dict[int, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="lm_eval_mc-") as tmp:
        root = Path(tmp)
        docs = task_folder(root, QUICK_QUESTIONS if args.quick else None)
        for name in SYSTEMS:
            server = Running(daemon(name, args.threads),
                             Path(tempfile.gettempdir()) / f"lm_eval_mc_{name}.log")
            try:
                samples[name] = lm_eval(server.spec.url, root, root / f"out-{name}")
            finally:
                server.stop()
            assert sorted(samples[name]) == list(range(len(docs))), name
            print(json.dumps({name: accuracy(samples[name])}), file=sys.stderr, flush=True)
    systems = {name: {**accuracy(found), "loglikelihoods": {
        str(i): choice_lls(found[i]) for i in range(len(docs))}}
        for name, found in samples.items()}
    between = compare(docs, samples["fp32"], samples["q4"])
    headline = {**{f"{name}/{m}": v for name, found in samples.items()
                   for m, v in accuracy(found).items()},
                **{k: v for k, v in between.items() if k != "differing"}}
    finish("lm_eval_mc", {"machine": machine(), "questions": len(docs), "systems": systems,
                          "fp32_vs_q4": between, "headline": headline})


if __name__ == "__main__":
    main()
