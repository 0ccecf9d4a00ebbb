"""Held-out acceptance of a draft: the target's greedy answers to the
benchmark chat prompts (bench/prompts.py: the topic prompts, whose topics no
training prompt uses, and the mixed requests, which no training generator
makes), drafted at a fixed k by specpage's engine. Per-token acceptance is accepted
/ tested draft tokens (a proposal is tested when every proposal before it was
accepted): the a for which a step yields (1 - a^(k+1)) / (1 - a) tokens on
average. Accepted / drafted is reported too.

    python -m draft.evaluate --draft models/smollm2-draft --k 1 2 3 4 5 6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.prompts import chat_prompts, mixed_prompts
from specpage.engine import EngineConfig
from specpage.llm import LLM, chat_prompt
from specpage.request import SamplingParams

PROMPT_SETS = {"topics": chat_prompts, "mixed": mixed_prompts}


def held_out_acceptance(draft: Path, k: int = 4, prompts: int = 32, max_tokens: int = 128,
                        batch: int = 32, prompt_set: str = "topics") -> dict[str, float]:
    llm = LLM("smollm2-135m", draft=draft,
              config=EngineConfig(num_blocks=4096, max_num_seqs=batch, spec_k=k,
                                  adaptive_k=False))
    texts = PROMPT_SETS[prompt_set](prompts)
    chats = [chat_prompt(llm.tokenizer, text) for text in texts]
    outputs = llm.generate(chats, SamplingParams(max_tokens=max_tokens, temperature=0))
    stats = llm.engine.stats()
    by_position = [n / max(1, stats.drafted_tokens // k) for n in stats.accepted_by_position]
    return {"k": k, "prompts": prompts, "prompt_set": prompt_set,
            "output_tokens": sum(len(o.samples[0].token_ids) for o in outputs),
            "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
            "per_token_acceptance": stats.per_token_acceptance,
            "accepted_over_drafted": stats.acceptance,
            "accepted_by_position": [round(p, 3) for p in by_position]}


def draft_costs(draft: Path, dtype: str = "auto") -> dict[str, object]:
    """The draft's forward as a fraction of the target's, at 1 and 32
    positions, from the costs the engine measures for its policy when it
    starts (spec/calibrate.py), in the dtype the daemon runs."""
    llm = LLM("smollm2-135m", draft=draft, dtype=dtype,
              config=EngineConfig(num_blocks=4096, max_num_seqs=32, spec_k=4))
    policy = llm.engine.core.policy
    target, proposer = policy.target_cost, policy.draft_cost
    return {"dtype": dtype, **{f"draft_over_target_at_{n}": round(proposer(n) / target(n), 4)
                               for n in (1, 4, 32)},
            "target_ms_at_1": round(1e3 * target(1), 3),
            "draft_ms_at_1": round(1e3 * proposer(1), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draft", type=Path, default=Path("models/smollm2-draft"))
    parser.add_argument("--k", type=int, nargs="+", default=[4], help="one run per k")
    parser.add_argument("--prompt-set", choices=[*PROMPT_SETS, "both"], default="both",
                        help="the benchmark's topic prompts, the mixed requests, or both")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--costs", action="store_true",
                        help="also the draft's forward cost as a fraction of the target's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.costs:
        print(json.dumps(draft_costs(args.draft)), flush=True)
    sets = list(PROMPT_SETS) if args.prompt_set == "both" else [args.prompt_set]
    for prompt_set in sets:
        for k in args.k:
            print(json.dumps(held_out_acceptance(args.draft, k, args.prompts, args.max_tokens,
                                                 prompt_set=prompt_set)), flush=True)


if __name__ == "__main__":
    main()
