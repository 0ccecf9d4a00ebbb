"""Runs inside vLLM's own virtual environment (.venv-vllm, made by
bench/vllm_cpu.py); it imports nothing from specpage. Reads one job as JSON
from the file named on the command line and prints its result as JSON on the
last line.

Jobs:
  {"kind": "throughput", "model": DIR, "prompts": [[ids]], "lengths": [n]}
  {"kind": "single", "model": DIR, "prompts": [[ids]], "tokens": n,
   "draft": DIR or null, "k": 4}: the prompts one at a time
"""

from __future__ import annotations

import json
import sys
import time


def engine(model: str, draft: str | None = None, k: int = 4):
    from vllm import LLM

    kwargs = {}
    if draft:
        kwargs["speculative_config"] = {"method": "draft_model", "model": draft,
                                        "num_speculative_tokens": k}
    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024,
               max_num_seqs=64, seed=0, disable_log_stats=True, **kwargs)


def generate(llm, prompts: list[list[int]], lengths: list[int],
             ignore_eos: bool = True) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos)
              for n in lengths]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [list(o.outputs[0].token_ids) for o in outputs], seconds


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import vllm

    result: dict = {"vllm": vllm.__version__}
    started = time.perf_counter()
    if job["kind"] == "throughput":
        llm = engine(job["model"])
        result["startup_s"] = time.perf_counter() - started
        generate(llm, job["prompts"][:2], [4, 4])  # warm-up
        tokens, seconds = generate(llm, job["prompts"], job["lengths"])
        result.update(tok_s=sum(job["lengths"]) / seconds, outputs=tokens)
    else:
        llm = engine(job["model"], job.get("draft"), job.get("k", 4))
        result["startup_s"] = time.perf_counter() - started
        generate(llm, job["prompts"][:1], [4])  # warm-up
        outputs, total = [], 0.0
        for prompt in job["prompts"]:  # to EOS or the limit, as the other engines
            tokens, seconds = generate(llm, [prompt], [job["tokens"]], ignore_eos=False)
            outputs += tokens
            total += seconds
        count = sum(map(len, outputs))
        result.update(ms_per_token=total / count * 1e3, outputs=outputs)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
