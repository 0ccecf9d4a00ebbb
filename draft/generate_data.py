"""Generate distillation data: the target's own answers to varied chat
prompts, made with specpage's batched engine, appended to JSONL shards so a
run can stop and resume. Each line: {"prompt": [...ids], "output": [...ids],
"temperature": t}.

    python -m draft.generate_data --out draft/data --tokens 1000000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from bench.prompts import TOPICS
from draft.prompts import topic_words, training_prompts
from specpage.engine import EngineConfig
from specpage.llm import LLM, chat_prompt
from specpage.models.fetch import ensure_model
from specpage.request import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("draft/data"))
    parser.add_argument("--tokens", type=int, default=1_000_000, help="output tokens to make")
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--sampled-fraction", type=float, default=0.2,
                        help="share of answers sampled at temperature 0.7 (the rest greedy)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(ensure_model("smollm2-135m"),
              config=EngineConfig(num_blocks=4096, max_num_seqs=args.batch, spec_k=0))
    held_out = {w.lower() for topic in TOPICS for w in topic.split()}
    words = topic_words(llm.tokenizer, held_out)
    args.out.mkdir(parents=True, exist_ok=True)
    shard = args.out / f"answers-seed{args.seed}.jsonl"
    done_lines = shard.read_text().count("\n") if shard.exists() else 0
    made = sum(len(json.loads(line)["output"]) for line in shard.open()) if done_lines else 0
    prompts = training_prompts(words, 200_000, args.seed)
    rng = random.Random(args.seed + 1)
    temperatures = [0.7 if rng.random() < args.sampled_fraction else 0.0 for _ in prompts]
    start, index = time.perf_counter(), done_lines
    with shard.open("a") as out:
        while made < args.tokens and index < len(prompts):
            batch = range(index, min(index + args.batch, len(prompts)))
            ids = [chat_prompt(llm.tokenizer, prompts[i]) for i in batch]
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperatures[i],
                                     seed=args.seed * 1_000_003 + i) for i in batch]
            for i, prompt, completion in zip(batch, ids, llm.generate(ids, params), strict=True):
                output = completion.samples[0].token_ids
                out.write(json.dumps({"prompt": prompt, "output": output,
                                      "temperature": temperatures[i]}) + "\n")
                made += len(output)
            out.flush()
            index = batch.stop
            rate = made / max(1e-9, time.perf_counter() - start)
            print(f"{index} answers, {made} tokens, {rate:.0f} tok/s", file=sys.stderr)
    print(json.dumps({"answers": index, "tokens": made, "shard": str(shard)}))


if __name__ == "__main__":
    main()
