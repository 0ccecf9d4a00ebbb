"""Speculative decoding with the draft pair (SmolLM2-135M-Instruct and the
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

Every variant first runs the first prompt untimed (the same warm-up for
all), then all variants run every prompt in rotated order for several rounds
(bench/common.py): medians and min–max spreads of ms per token count, and a
ratio whose spreads overlap is "level". Outputs end at EOS or max tokens.
vLLM's configurations are tried as in bench/engine.py, the fastest counting
as "vLLM alone".
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import compare, finish, machine, parse_args, rotated, rounds  # noqa: E402
from bench.prompts import chat_prompts  # noqa: E402
from bench.vllm_cpu import VllmPeer, modes, start_peers  # noqa: E402
from specpage.core.request import SamplingParams  # noqa: E402
from specpage.engine import EngineConfig  # noqa: E402
from specpage.llm import LLM, chat_prompt  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402


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


WARMUP_TOKENS = 4  # each variant's untimed first run: one prompt, this many tokens


@dataclass(frozen=True)
class Prompts:
    prompts: list[list[int]]
    max_tokens: int


class Timed:
    """One specpage configuration: ms per output token over the prompts, one
    at a time; keeps the outputs of its last run."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.outputs: list[list[int]] = []

    def __call__(self, job: Prompts) -> float:
        params = SamplingParams(max_tokens=job.max_tokens, temperature=0)
        outputs, seconds = [], 0.0
        for prompt in job.prompts:
            start = time.perf_counter()
            outputs.append(self.llm.generate([prompt], params)[0].samples[0].token_ids)
            seconds += time.perf_counter() - start
        self.outputs = outputs
        return seconds / max(1, sum(map(len, outputs))) * 1e3


class TimedHF:
    def __init__(self, model: Any, assistant: Any = None) -> None:
        self.model, self.assistant = model, assistant

    def __call__(self, job: Prompts) -> float:
        seconds, tokens = 0.0, 0
        for prompt in job.prompts:
            ids = torch.tensor([prompt])
            kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": job.max_tokens,
                      "do_sample": False, "pad_token_id": 2}
            if self.assistant is not None:
                kwargs["assistant_model"] = self.assistant
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(ids, **kwargs)
            seconds += time.perf_counter() - start
            tokens += out.shape[1] - ids.shape[1]
        return seconds / max(1, tokens) * 1e3


class TimedVllm:
    def __init__(self, peer: VllmPeer) -> None:
        self.peer = peer

    def __call__(self, job: Prompts) -> float:
        outputs, seconds = self.peer.generate(job.prompts, [job.max_tokens] * len(job.prompts),
                                              ignore_eos=False, one_at_a_time=True)
        return seconds / max(1, sum(map(len, outputs))) * 1e3


def main() -> None:
    args = parse_args(__doc__, vllm=True)
    if not (args.draft / "config.json").is_file():
        sys.exit(f"no draft at {args.draft}: train it with `python -m draft.train`")
    from transformers import AutoModelForCausalLM

    target = ensure_model("smollm2-135m")
    count, max_tokens = (2, 24) if args.quick else (8, 128)
    config = {"num_blocks": 512, "max_num_seqs": 4}
    peers: dict[str, VllmPeer] = {}
    vllm_errors: dict[str, str] = {}
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
        prompts = Prompts([chat_prompt(tokenizer, text) for text in chat_prompts(count)],
                          max_tokens)
        hf_target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        hf_draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
        systems: dict[str, Callable[[Prompts], float]] = {
            **engines, "hf_generate": TimedHF(hf_target),
            "hf_assisted": TimedHF(hf_target, hf_draft)}
        if not args.no_vllm:
            configs = {name: {"model": str(target), **mode}
                       for name, mode in modes(args.quick, args.vllm_modes).items()}
            configs["vllm_with_draft"] = {"model": str(target), "dtype": "float32", "eager": True,
                                          "draft": str(args.draft), "k": 4}
            peers, vllm_errors = start_peers(configs, args.threads)
            systems.update({name: TimedVllm(peer) for name, peer in peers.items()})
        try:
            spreads = rotated(systems, prompts, Prompts(prompts.prompts[:1], WARMUP_TOKENS),
                              rounds(args.quick))
        finally:
            for peer in peers.values():
                peer.close()
    off = engines["off"]
    off_tokens = sum(map(len, off.outputs))
    count_rounds = rounds(args.quick)
    stats = {name: e.llm.engine.stats() for name, e in engines.items()}
    alone = [name for name in peers if name != "vllm_with_draft"]
    if alone:
        spreads["vllm_alone"] = min((spreads[name] for name in alone), key=lambda s: s.median)
    ms = {name: spread.as_json() for name, spread in spreads.items()}

    def vs_off(name: str) -> dict[str, Any]:
        return compare(spreads[name], spreads["off"], higher_is_better=False)

    result = {
        "bench": "speculation",
        "model": "SmolLM2-135M-Instruct fp32 + draft models/smollm2-draft, greedy, batch 1",
        "prompts": count, "max_tokens": max_tokens, "rounds": count_rounds,
        "output_tokens": off_tokens,
        "ms_per_token": ms,
        "per_token_acceptance_k4": stats["fixed_k4"].per_token_acceptance,
        "accepted_over_drafted_k4": stats["fixed_k4"].acceptance,
        "per_token_acceptance_adaptive": stats["adaptive"].per_token_acceptance,
        "adaptive_mean_k": stats["adaptive"].drafted_tokens
        / max(1, off_tokens * count_rounds + WARMUP_TOKENS),
        # ratios: above 1 means the first named is faster
        "adaptive_vs_off": vs_off("adaptive"),
        "fixed_k4_vs_off": vs_off("fixed_k4"),
        "useless_draft_vs_off": vs_off("useless_draft_adaptive"),
        "same_tokens_as_off": {name: sum(a == b for a, b in zip(e.outputs, off.outputs,
                                                                 strict=True)) / count
                               for name, e in engines.items() if name != "off"},
        "adaptive_vs_hf_assisted": compare(spreads["adaptive"], spreads["hf_assisted"],
                                           higher_is_better=False),
        "off_vs_hf_generate": compare(spreads["off"], spreads["hf_generate"],
                                      higher_is_better=False),
    }
    if alone:
        result["vllm_best"] = min(alone, key=lambda name: spreads[name].median)
        result["adaptive_vs_vllm_alone"] = compare(spreads["adaptive"], spreads["vllm_alone"],
                                                   higher_is_better=False)
        result["off_vs_vllm_alone"] = compare(spreads["off"], spreads["vllm_alone"],
                                              higher_is_better=False)
    result["vllm_startup_s"] = {name: p.ready["startup_s"] for name, p in peers.items()}
    if vllm_errors or args.no_vllm:
        result["vllm_errors"] = vllm_errors or {"all": "skipped (--no-vllm)"}
    finish("speculation", {**result, "machine": machine()})


if __name__ == "__main__":
    main()
