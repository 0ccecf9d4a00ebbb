"""Runs inside vLLM's own virtual environment (.venv-vllm, made by
bench/vllm_cpu.py); it imports nothing from specpage. One process holds one
engine configuration for a whole benchmark, so that vLLM takes its turn in
the same rotated rounds as the other systems.

    python vllm_worker.py CONFIG_JSON

CONFIG_JSON: {"model": DIR, "dtype": "float32" | "bfloat16", "eager": bool,
              "draft": DIR or null, "k": 4, "max_num_seqs": 64}
Once the engine is up it prints {"vllm_ready": {"vllm": version, "startup_s": s}}.
Then each line on stdin is a job, answered by one line {"vllm_result": ...}:
  {"prompts": [[ids]], "lengths": [n], "ignore_eos": bool, "one_at_a_time": bool}
  -> {"seconds": s, "outputs": [[ids]]}
An empty line or end of input ends the process. Result lines are marked
because vLLM logs to stdout too.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def engine(config: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if config.get("draft"):
        kwargs["speculative_config"] = {"method": "draft_model", "model": config["draft"],
                                        "num_speculative_tokens": config.get("k", 4)}
    # max_model_len 2048 and the default tokens per step, as vLLM's own server
    # runs: its whole batch of short chat prompts prefills in one step.
    return LLM(model=config["model"], dtype=config["dtype"], enforce_eager=config["eager"],
               max_model_len=2048, max_num_seqs=config.get("max_num_seqs", 64), seed=0,
               disable_log_stats=True, **kwargs)


def generate(llm: Any, prompts: list[list[int]], lengths: list[int],
             ignore_eos: bool) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos)
              for n in lengths]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [list(o.outputs[0].token_ids) for o in outputs], seconds


def answer(key: str, value: dict[str, Any]) -> None:
    print(json.dumps({key: value}), flush=True)


def main() -> None:
    config = json.loads(sys.argv[1])
    import vllm

    started = time.perf_counter()
    llm = engine(config)
    answer("vllm_ready", {"vllm": vllm.__version__, "startup_s": time.perf_counter() - started})
    for line in sys.stdin:
        if not line.strip():
            break
        job = json.loads(line)
        pairs = list(zip(job["prompts"], job["lengths"], strict=True))
        if job.get("one_at_a_time"):
            outputs, seconds = [], 0.0
            for prompt, length in pairs:
                tokens, spent = generate(llm, [prompt], [length], job["ignore_eos"])
                outputs += tokens
                seconds += spent
        else:
            outputs, seconds = generate(llm, job["prompts"], job["lengths"], job["ignore_eos"])
        answer("vllm_result", {"seconds": seconds, "outputs": outputs})


if __name__ == "__main__":
    main()
