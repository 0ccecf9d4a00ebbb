"""Held-out acceptance of a draft: the target's greedy answers to the
benchmark chat prompts (bench/prompts.py, whose topics no training prompt
uses), drafted at a fixed k by specpage's engine. Per-token acceptance is accepted
/ tested draft tokens (a proposal is tested when every proposal before it was
accepted): the a for which a step yields (1 - a^(k+1)) / (1 - a) tokens on
average. Accepted / drafted is reported too.

    python -m draft.evaluate --draft models/smollm2-draft --k 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.prompts import chat_prompts
from specpage.engine import EngineConfig
from specpage.llm import LLM, chat_prompt
from specpage.request import SamplingParams


def held_out_acceptance(draft: Path, k: int = 4, prompts: int = 32, max_tokens: int = 128,
                        batch: int = 32) -> dict[str, float]:
    llm = LLM("smollm2-135m", draft=draft,
              config=EngineConfig(num_blocks=4096, max_num_seqs=batch, spec_k=k,
                                  adaptive_k=False))
    chats = [chat_prompt(llm.tokenizer, text) for text in chat_prompts(prompts)]
    outputs = llm.generate(chats, SamplingParams(max_tokens=max_tokens, temperature=0))
    stats = llm.engine.stats()
    by_position = [n / max(1, stats.drafted_tokens // k) for n in stats.accepted_by_position]
    return {"k": k, "prompts": prompts,
            "output_tokens": sum(len(o.samples[0].token_ids) for o in outputs),
            "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
            "per_token_acceptance": stats.per_token_acceptance,
            "accepted_over_drafted": stats.acceptance,
            "accepted_by_position": [round(p, 3) for p in by_position]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draft", type=Path, default=Path("models/smollm2-draft"))
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(held_out_acceptance(args.draft, args.k, args.prompts, args.max_tokens)))


if __name__ == "__main__":
    main()
