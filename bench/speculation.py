"""Speculative decoding with the default pair (SmolLM2-135M-Instruct and the
distilled draft in models/smollm2-draft), single stream, greedy, on held-out
chat prompts (bench/prompts.py; no training prompt uses their topics), in
one run:

- time per output token: target alone (speculation off), specpage
  speculative with adaptive k and with k fixed at 4, HF `generate`, HF
  assisted generation with the same draft, and vLLM's CPU build alone and
  with the same draft where it supports that;
- per-token acceptance at k = 4 (accepted / tested proposals);
- the guard: adaptive k with a useless draft (the draft's architecture with
  random weights) against speculation off; it must cost at most 5%.

Variants run prompt by prompt in turn, so a slow spell of the machine
touches them all alike. Outputs end at EOS or max tokens.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish, machine, parse_args  # noqa: E402
from bench.prompts import chat_prompts  # noqa: E402
from bench.vllm_cpu import run_job  # noqa: E402
from specpage.engine import EngineConfig  # noqa: E402
from specpage.llm import LLM, chat_prompt  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402
from specpage.request import SamplingParams  # noqa: E402


def useless_draft(draft: Path, out: Path) -> Path:
    """The draft's architecture and tokenizer with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(draft))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (draft / name).is_file():
            shutil.copy(draft / name, out / name)
    return out


class Timed:
    """One engine configuration, timed over the prompts it has run."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.seconds, self.tokens, self.outputs = llm, 0.0, 0, []

    def run(self, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        start = time.perf_counter()
        out = self.llm.generate([prompt], params)[0].samples[0].token_ids
        self.seconds += time.perf_counter() - start
        self.tokens += len(out)
        self.outputs.append(out)

    @property
    def ms_per_token(self) -> float:
        return self.seconds / max(1, self.tokens) * 1e3


class TimedHF:
    def __init__(self, model: Any, assistant: Any = None) -> None:
        self.model, self.assistant = model, assistant
        self.seconds, self.tokens = 0.0, 0

    def run(self, prompt: list[int], max_tokens: int) -> None:
        ids = torch.tensor([prompt])
        kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": max_tokens,
                  "do_sample": False, "pad_token_id": 2}
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, **kwargs)
        self.seconds += time.perf_counter() - start
        self.tokens += out.shape[1] - ids.shape[1]

    @property
    def ms_per_token(self) -> float:
        return self.seconds / max(1, self.tokens) * 1e3


def vllm_single(target: Path, draft: Path | None, prompts: list[list[int]],
                max_tokens: int, threads: int) -> dict[str, Any]:
    """ms per output token over the prompts, one at a time, in one vLLM process."""
    job = {"kind": "single", "model": str(target), "prompts": prompts, "tokens": max_tokens,
           "draft": str(draft) if draft else None, "k": 4}
    result = run_job(job, threads)
    result.pop("outputs", None)
    return result


def main() -> None:
    args = parse_args(__doc__, vllm=True)
    if not (args.draft / "config.json").is_file():
        sys.exit(f"no draft at {args.draft}: train it with `python -m draft.train`")
    from transformers import AutoModelForCausalLM

    target = ensure_model("smollm2-135m")
    count, max_tokens = (2, 24) if args.quick else (8, 128)
    config = {"num_blocks": 512, "max_num_seqs": 4}
    with tempfile.TemporaryDirectory() as tmp:
        useless = useless_draft(args.draft, Path(tmp) / "useless")
        engines = {
            "off": Timed(LLM(target, config=EngineConfig(spec_k=0, **config))),
            "adaptive": Timed(LLM(target, draft=args.draft,
                                  config=EngineConfig(spec_k=6, adaptive_k=True, **config))),
            "fixed_k4": Timed(LLM(target, draft=args.draft,
                                  config=EngineConfig(spec_k=4, adaptive_k=False, **config))),
            "useless_draft_adaptive": Timed(LLM(target, draft=useless, config=EngineConfig(
                spec_k=6, adaptive_k=True, **config))),
        }
        tokenizer = engines["off"].llm.tokenizer
        prompts = [chat_prompt(tokenizer, text) for text in chat_prompts(count)]
        hf_target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        hf_draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
        hf = {"hf_generate": TimedHF(hf_target), "hf_assisted": TimedHF(hf_target, hf_draft)}
        for timed in [*engines.values(), *hf.values()]:  # warm-up
            timed.run(prompts[0], 4)
            timed.seconds, timed.tokens = 0.0, 0
            if isinstance(timed, Timed):
                timed.outputs = []
        for prompt in prompts:
            for timed in [*engines.values(), *hf.values()]:
                timed.run(prompt, max_tokens)
    off = engines["off"]
    stats = {name: e.llm.engine.stats() for name, e in engines.items()}
    vllm = {}
    if not args.no_vllm:
        vllm = {"alone": vllm_single(target, None, prompts, max_tokens, args.threads),
                "with_draft": vllm_single(target, args.draft, prompts, max_tokens, args.threads)}
    ms = {name: e.ms_per_token for name, e in engines.items()}
    ms.update({name: h.ms_per_token for name, h in hf.items()})
    for name, result in vllm.items():
        if "ms_per_token" in result:
            ms[f"vllm_{name}"] = result["ms_per_token"]
    result = {
        "bench": "speculation",
        "model": "SmolLM2-135M-Instruct fp32 + draft models/smollm2-draft, greedy, batch 1",
        "prompts": count, "max_tokens": max_tokens,
        "output_tokens": off.tokens,
        "ms_per_token": ms,
        "per_token_acceptance_k4": stats["fixed_k4"].per_token_acceptance,
        "accepted_over_drafted_k4": stats["fixed_k4"].acceptance,
        "per_token_acceptance_adaptive": stats["adaptive"].per_token_acceptance,
        "adaptive_mean_k": stats["adaptive"].drafted_tokens / max(1, off.tokens),
        "speedup_adaptive": off.ms_per_token / engines["adaptive"].ms_per_token,
        "speedup_fixed_k4": off.ms_per_token / engines["fixed_k4"].ms_per_token,
        "useless_draft_slowdown": engines["useless_draft_adaptive"].ms_per_token / off.ms_per_token,
        "same_tokens_as_off": {name: sum(a == b for a, b in zip(e.outputs, off.outputs,
                                                                 strict=True)) / count
                               for name, e in engines.items() if name != "off"},
        "specpage_spec_vs_hf_assisted": hf["hf_assisted"].ms_per_token
        / engines["adaptive"].ms_per_token,
        "specpage_off_vs_hf": hf["hf_generate"].ms_per_token / off.ms_per_token,
        "vllm": vllm,
        "machine": machine(),
    }
    finish("speculation", result)


if __name__ == "__main__":
    main()
