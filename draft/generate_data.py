"""Generate distillation data: the target's own answers to varied chat
prompts, made with specpage's batched engine, appended to JSONL shards so a
run can stop and resume. Each line: {"index": i, "prompt": [...ids],
"output": [...ids], "temperature": t}.

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
from draft.prompts import CHAT_TEMPLATES, topic_words, training_prompts
from draft.topics import curated_topics
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
    parser.add_argument("--topics", choices=["vocab", "curated"], default="vocab",
                        help="topic words from the tokenizer, or draft/topics.py")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(ensure_model("smollm2-135m"),
              config=EngineConfig(num_blocks=4096, max_num_seqs=args.batch, spec_k=0))
    held_out = {w.lower() for topic in TOPICS for w in topic.split()}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.topics == "vocab":
        shard = args.out / f"answers-seed{args.seed}.jsonl"
        prompts = training_prompts(topic_words(llm.tokenizer, held_out), 200_000, args.seed)
    else:
        shard = args.out / f"answers-curated-seed{args.seed}.jsonl"
        prompts = training_prompts(curated_topics(held_out), 200_000, args.seed,
                                   CHAT_TEMPLATES)
    done = [json.loads(line) for line in shard.open()] if shard.exists() else []
    made = sum(len(record["output"]) for record in done)
    # Resume after the highest prompt done; answers in flight at a stop are skipped.
    done_lines = 1 + max((r.get("index", n) for n, r in enumerate(done)), default=-1)
    rng = random.Random(args.seed + 1)
    temperatures = [0.7 if rng.random() < args.sampled_fraction else 0.0 for _ in prompts]
    engine = llm.engine
    start, index, answers, made_before = time.perf_counter(), done_lines, len(done), made
    outputs: dict[str, list[int]] = {}
    with shard.open("a") as out:
        # Continuous batching: a new prompt joins whenever an answer ends.
        while made < args.tokens and (index < len(prompts) or engine.has_unfinished()):
            while len(outputs) < args.batch and index < len(prompts) and made < args.tokens:
                engine.add_request(str(index), chat_prompt(llm.tokenizer, prompts[index]),
                                   SamplingParams(max_tokens=args.max_tokens,
                                                  temperature=temperatures[index],
                                                  seed=args.seed * 1_000_003 + index))
                outputs[str(index)] = []
                index += 1
            for event in engine.step():
                outputs[event.request_id] += event.token_ids
                if event.finished:
                    i = int(event.request_id)
                    output = outputs.pop(event.request_id)
                    out.write(json.dumps({"index": i,
                                          "prompt": chat_prompt(llm.tokenizer, prompts[i]),
                                          "output": output,
                                          "temperature": temperatures[i]}) + "\n")
                    made += len(output)
                    answers += 1
                    if answers % 50 == 0:
                        out.flush()
                        rate = (made - made_before) / max(1e-9, time.perf_counter() - start)
                        print(f"{answers} answers, {made} tokens, {rate:.0f} tok/s",
                              file=sys.stderr)
    print(json.dumps({"answers": answers, "tokens": made, "shard": str(shard)}))


if __name__ == "__main__":
    main()
