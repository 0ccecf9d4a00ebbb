"""The engine on SmolLM2-135M fp32, one run, against HF transformers.

(a) Aggregate output tokens/s for concurrent requests of mixed prompt and
    output lengths (greedy, EOS ignored so every engine produces the same
    tokens): specpage's continuous batching, HF `generate` with static
    left-padded batches (it decodes to the longest request; only requested
    tokens count), and HF continuous batching (`generate_batch` with an
    explicit ContinuousBatchingConfig, one max_new_tokens for all, so it too
    runs to the longest and only requested tokens count).
(b) Single-stream time per output token: target alone, specpage speculative
    (the target as its own draft: the upper bound of acceptance), and HF
    assisted generation with the same draft.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish, machine  # noqa: E402
from bench.prompts import chat_prompts  # noqa: E402
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


def single_stream(llm_plain: LLM, llm_spec: LLM, hf, prompt: list[int], tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm_plain.generate([prompt], SamplingParams(max_tokens=4, temperature=0))
    llm_spec.generate([prompt], SamplingParams(max_tokens=4, temperature=0))
    plain, t_plain = timed(lambda: llm_plain.generate([prompt], params)[0])
    spec, t_spec = timed(lambda: llm_spec.generate([prompt], params)[0])
    assert spec.samples[0].token_ids == plain.samples[0].token_ids  # exact
    ids = torch.tensor([prompt])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                  eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        _, t_hf = timed(lambda: hf.generate(ids, **kwargs))
        _, t_assisted = timed(lambda: hf.generate(ids, assistant_model=hf, **kwargs))
    usage = spec.usage
    return {
        "tokens": tokens,
        "ms_per_token": {"specpage_target_alone": t_plain / tokens * 1e3,
                         "specpage_speculative_self_draft": t_spec / tokens * 1e3,
                         "hf_generate": t_hf / tokens * 1e3,
                         "hf_assisted_self_draft": t_assisted / tokens * 1e3},
        "acceptance": usage.accepted_tokens / max(1, usage.drafted_tokens),
        "speculative_vs_alone": t_plain / t_spec,
        "specpage_alone_vs_hf": t_hf / t_plain,
        "specpage_spec_vs_hf_assisted": t_assisted / t_spec,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    folder = ensure_model("smollm2-135m")
    count, (low, high), single = (8, (8, 24), 24) if args.quick else (32, (32, 128), 96)
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
    for name, value in throughput.items():
        print(f"{name}: {value:.1f} output tokens/s", file=sys.stderr)
    # k fixed at 4: with the target as its own draft, adaptive k would (rightly)
    # turn speculation off, and this row is the upper bound of acceptance.
    spec = LLM(folder, draft=folder, config=EngineConfig(num_blocks=512, spec_k=4,
                                                         adaptive_k=False))
    stream = single_stream(plain, spec, hf, prompts[0], single)
    print(stream, file=sys.stderr)
    finish("engine", {
        "bench": "engine",
        "model": "SmolLM2-135M-Instruct fp32, greedy",
        "requests": count,
        "output_tokens": sum(lengths),
        "throughput_tok_s": throughput,
        "specpage_vs_hf_static": throughput["specpage"] / throughput["hf_static_batch"],
        "specpage_vs_hf_continuous": throughput["specpage"] / throughput["hf_continuous_batching"],
        "single_stream": stream,
        "machine": machine(),
    })


if __name__ == "__main__":
    main()
