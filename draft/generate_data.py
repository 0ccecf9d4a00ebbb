"""Generate distillation data: the target's own answers to varied chat
prompts, made with specpage's batched engine, appended to JSONL shards so a
run can stop and resume. Each line: {"index": i, "prompt": [...ids],
"output": [...ids], "temperature": t}.

    python -m draft.generate_data --out draft/data --tokens 1000000
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from pathlib import Path

import torch

from bench.prompts import TOPICS
from draft.chat import Request, chat_requests, sentences
from draft.prompts import CHAT_TEMPLATES, topic_words, training_prompts
from draft.topics import curated_topics
from specpage.core.request import SamplingParams
from specpage.engine import EngineConfig
from specpage.llm import LLM, chat_prompt, conversation_prompt
from specpage.models.fetch import ensure_model

# The answers whose sentences the chat requests rewrite (the shards of the
# other two kinds; the chat shard's own snapshot is not among them).
REWRITE_SOURCES = ("answers-curated-seed0.jsonl.gz", "answers-seed0.jsonl.gz")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("draft/data"))
    parser.add_argument("--tokens", type=int, default=1_000_000, help="output tokens to make")
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--sampled-fraction", type=float, default=0.2,
                        help="share of answers sampled at temperature 0.7 (the rest greedy)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--topics", choices=["vocab", "curated", "chat"], default="vocab",
                        help="topic words from the tokenizer, draft/topics.py, or the "
                        "broad requests of draft/chat.py (with follow-up turns)")
    parser.add_argument("--dtype", default=None, help="the target's dtype (default: its own)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(ensure_model("smollm2-135m"), dtype=args.dtype,
              config=EngineConfig(num_blocks=4096, max_num_seqs=args.batch, spec_k=0))
    held_out = {w.lower() for topic in TOPICS for w in topic.split()}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.topics == "vocab":
        shard = args.out / f"answers-seed{args.seed}.jsonl"
        prompts = [Request(t) for t in
                   training_prompts(topic_words(llm.tokenizer, held_out), 200_000, args.seed)]
    elif args.topics == "curated":
        shard = args.out / f"answers-curated-seed{args.seed}.jsonl"
        prompts = [Request(t) for t in training_prompts(curated_topics(held_out), 200_000,
                                                        args.seed, CHAT_TEMPLATES)]
    else:
        shard = args.out / f"answers-chat-seed{args.seed}.jsonl"
        sources = []
        for name in REWRITE_SOURCES:
            path = Path("draft/snapshots") / name
            with gzip.open(path, "rt") as lines:
                sources += [llm.tokenizer.decode(json.loads(line)["output"],
                                                 skip_special_tokens=True) for line in lines]
        prompts = chat_requests(50_000, args.seed, sentences(sources),
                                topics=curated_topics(held_out))
    done = [json.loads(line) for line in shard.open()] if shard.exists() else []
    made = sum(len(record["output"]) for record in done)
    # Resume after the highest prompt done; answers in flight at a stop are skipped.
    done_lines = 1 + max((r.get("index", n) for n, r in enumerate(done)), default=-1)
    rng = random.Random(args.seed + 1)
    temperatures = [0.7 if rng.random() < args.sampled_fraction else 0.0 for _ in prompts]
    engine = llm.engine
    start, index, answers, made_before = time.perf_counter(), done_lines, len(done), made
    outputs: dict[str, list[int]] = {}
    asked: dict[str, tuple[int, int, list[int]]] = {}  # request id -> (index, turn, prompt)

    def ask(i: int, turn: int, ids: list[int]) -> None:
        request_id = f"{i}.{turn}"
        engine.add_request(request_id, ids, SamplingParams(
            max_tokens=args.max_tokens, temperature=temperatures[i],
            seed=args.seed * 1_000_003 + i + turn))
        outputs[request_id], asked[request_id] = [], (i, turn, ids)

    with shard.open("a") as out:
        # Continuous batching: a new prompt joins whenever an answer ends.
        while made < args.tokens and (index < len(prompts) or engine.has_unfinished()):
            while len(outputs) < args.batch and index < len(prompts) and made < args.tokens:
                ask(index, 0, chat_prompt(llm.tokenizer, prompts[index].text))
                index += 1
            for event in engine.step():
                outputs[event.request_id] += event.token_ids
                if event.finished:
                    output = outputs.pop(event.request_id)
                    i, turn, prompt = asked.pop(event.request_id)
                    follow_up = prompts[i].follow_up
                    if follow_up and turn == 0:  # ask the second turn
                        answer = llm.tokenizer.decode(output, skip_special_tokens=True)
                        ask(i, 1, conversation_prompt(llm.tokenizer, [
                            prompts[i].text, answer, follow_up]))
                    out.write(json.dumps({"index": i, "prompt": prompt, "output": output,
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
