"""Soft labels for distillation: the target's top-K next-token log-probabilities
at every answer position of the data from draft/generate_data.py, so the draft
learns the target's whole preference order, not only its first choice.

One file per data shard (`<shard>.top<K>.pt`), written in chunks as it goes
(`<shard>.top<K>.part<N>.pt`) so a stopped run resumes; the chunks are joined
at the end. Each answer maps to (log-probs [n, K] fp16, token ids [n, K] int32)
for its n answer tokens, in the order draft/train.py reads them.

    python -m draft.label --data draft/data --top 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from draft.train import load_shard, soft_label_path
from specpage.models.fetch import ensure_model

CHUNK = 512  # answers per chunk file


@torch.inference_mode()
def label_chunk(model, examples: list[tuple[list[int], int]], top: int,
                max_batch_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Top-K log-probs for each example's answer tokens; batches of similar length."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    results: list = [None] * len(examples)
    start = 0
    while start < len(order):
        width = len(examples[order[start]][0])
        end = start + 1
        while (end < len(order)
               and len(examples[order[end]][0]) * (end - start + 1) <= max_batch_tokens):
            width = len(examples[order[end]][0])
            end += 1
        chosen = order[start:end]
        ids = torch.zeros(len(chosen), width, dtype=torch.int64)
        mask = torch.zeros(len(chosen), width, dtype=torch.int64)
        for row, i in enumerate(chosen):
            tokens = examples[i][0]
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for row, i in enumerate(chosen):
            tokens, answer = examples[i]
            logits = model.lm_head(hidden[row, answer - 1 : len(tokens) - 1])
            values, indices = torch.log_softmax(logits.float(), -1).topk(top, dim=-1)
            results[i] = (values.half(), indices.int())
        start = end
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=Path("draft/data"))
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--sequence-tokens", type=int, default=384,
                        help="the truncation draft/train.py uses")
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_model("smollm2-135m"),
                                                 dtype=torch.float32).eval()
    for shard in sorted(args.data.glob("*.jsonl")):
        final = soft_label_path(shard, args.top)
        if final.exists():
            continue
        examples = load_shard(shard, args.sequence_tokens)
        started, done = time.perf_counter(), 0
        parts = []
        for n, first in enumerate(range(0, len(examples), CHUNK)):
            part = final.with_suffix(f".part{n}.pt")
            parts.append(part)
            if part.exists():
                continue
            chunk = examples[first : first + CHUNK]
            torch.save(label_chunk(model, chunk, args.top, args.max_batch_tokens), part)
            done += sum(len(ids) for ids, _ in chunk)
            print(f"{shard.name}: {first + len(chunk)}/{len(examples)} answers, "
                  f"{done / (time.perf_counter() - started):.0f} tok/s", file=sys.stderr)
        labels = [item for part in parts for item in torch.load(part)]
        torch.save(labels, final)
        for part in parts:
            part.unlink()
        print(json.dumps({"shard": str(shard), "labels": str(final), "answers": len(labels)}))


if __name__ == "__main__":
    main()
