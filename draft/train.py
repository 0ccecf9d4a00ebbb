"""Train the default draft by distillation: a small Llama with SmolLM2's
tokenizer learns the target's answers (data from draft/generate_data.py),
loss on answer tokens only. Saves a standard HF checkpoint (fp16) that
transformers and specpage load, and reports the validation loss and
next-token agreement.

    python -m draft.train --data draft/data --out models/smollm2-draft
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import sys
import time
import tomllib
from pathlib import Path

import torch
import torch.nn.functional as F

from specpage.models.fetch import ensure_model

CONFIG = Path(__file__).with_name("config.toml")


def load_examples(folder: Path, max_len: int) -> list[tuple[list[int], int]]:
    """(token ids, index of the first answer token) per answer."""
    examples = []
    shards = sorted(folder.glob("*.jsonl")) + sorted(folder.glob("*.jsonl.gz"))
    for shard in shards:
        opener = gzip.open if shard.suffix == ".gz" else open
        for line in opener(shard, "rt"):
            record = json.loads(line)
            ids = (record["prompt"] + record["output"])[:max_len]
            if len(ids) > len(record["prompt"]):
                examples.append((ids, len(record["prompt"])))
    return examples


def build_draft(target_folder: Path, cfg: dict) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32)
    tc = target.config
    config = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_heads"], num_key_value_heads=cfg["num_kv_heads"],
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=getattr(tc, "rope_theta", None) or tc.rope_parameters["rope_theta"],
        tie_word_embeddings=True, bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id,
        pad_token_id=tc.pad_token_id,
    )
    draft = LlamaForCausalLM(config)
    if cfg.get("embedding_init") == "target-svd":
        with torch.no_grad():
            embedding = target.get_input_embeddings().weight  # [vocab, target hidden]
            _, _, v = torch.linalg.svd(embedding, full_matrices=False)
            projected = embedding @ v[: cfg["hidden_size"]].T  # [vocab, hidden]
            scale = embedding.norm(dim=-1).mean() / projected.norm(dim=-1).mean()
            draft.get_input_embeddings().weight.copy_(projected * scale)
    return draft


def batches(examples: list[tuple[list[int], int]], size: int, rng: random.Random):
    if not examples:
        raise ValueError("no training examples (run draft/generate_data.py first)")
    size = min(size, len(examples))
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            chosen = [examples[i] for i in order[start : start + size]]
            width = max(len(ids) for ids, _ in chosen)
            ids = torch.zeros(size, width, dtype=torch.int64)
            labels = torch.full((size, width), -100, dtype=torch.int64)
            for row, (tokens, answer) in enumerate(chosen):
                ids[row, : len(tokens)] = torch.tensor(tokens)
                labels[row, answer : len(tokens)] = torch.tensor(tokens[answer:])
            yield ids, labels


def loss_and_agreement(model, ids, labels) -> tuple[torch.Tensor, float]:
    logits = model(ids).logits[:, :-1]
    target = labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=-100)
    mask = target != -100
    agreement = float((logits.argmax(-1) == target)[mask].float().mean())
    return loss, agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=Path("draft/data"))
    parser.add_argument("--out", type=Path, default=Path("models/smollm2-draft"))
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--max-minutes", type=float, help="overrides train.max_minutes")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    config = tomllib.loads(args.config.read_text())
    train = config["train"]
    torch.manual_seed(train["seed"])
    torch.set_num_threads(args.threads)
    rng = random.Random(train["seed"])
    target_folder = ensure_model("smollm2-135m")
    examples = load_examples(args.data, train["sequence_tokens"])
    rng.shuffle(examples)
    held = max(1, int(len(examples) * train["held_out_fraction"]))
    validation, examples = examples[:held], examples[held:]
    model = build_draft(target_folder, config["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=train["learning_rate"],
                                  weight_decay=train["weight_decay"])
    minutes = args.max_minutes or train["max_minutes"]
    deadline = time.monotonic() + minutes * 60
    step, seen = 0, 0
    stream = batches(examples, train["batch_sequences"], rng)
    while time.monotonic() < deadline:
        ids, labels = next(stream)
        warm = min(1.0, (step + 1) / train["warmup_steps"])
        for group in optimizer.param_groups:
            group["lr"] = train["learning_rate"] * warm
        loss, agreement = loss_and_agreement(model, ids, labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        seen += int((labels != -100).sum())
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.3f}, agreement {agreement:.3f}, "
                  f"{seen} answer tokens", file=sys.stderr)
    model.eval()
    with torch.no_grad():
        losses, agreements = [], []
        for tokens, answer in validation:
            ids = torch.tensor([tokens])
            labels = torch.full_like(ids, -100)
            labels[0, answer:] = ids[0, answer:]
            loss, agreement = loss_and_agreement(model, ids, labels)
            losses.append(float(loss))
            agreements.append(agreement)
    args.out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(args.out)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(target_folder).save_pretrained(args.out)
    result = {"steps": step, "answer_tokens_seen": seen, "examples": len(examples),
              "validation_loss": sum(losses) / len(losses),
              "validation_perplexity": math.exp(sum(losses) / len(losses)),
              "validation_agreement": sum(agreements) / len(agreements),
              "out": str(args.out)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
