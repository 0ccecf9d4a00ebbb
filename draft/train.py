"""Train the default draft by distillation: a small Llama with SmolLM2's
tokenizer learns the target's answers (data from draft/generate_data.py),
loss on answer tokens only, a cosine learning-rate schedule over a fixed
number of steps. Saves a standard HF checkpoint (fp16) that transformers and
specpage load (also every `checkpoint_every` steps, so a stopped run keeps its
progress), and reports the validation loss, next-token agreement and the
per-token acceptance on held-out chat prompts (draft/evaluate.py).

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


Example = tuple[list[int], int, "SoftLabels | None"]
SoftLabels = tuple[torch.Tensor, torch.Tensor]  # target top-K log-probs, their token ids


def load_shard(shard: Path, max_len: int) -> list[tuple[list[int], int]]:
    """(token ids, index of the first answer token) per answer of one shard."""
    examples = []
    opener = gzip.open if shard.suffix == ".gz" else open
    for line in opener(shard, "rt"):
        record = json.loads(line)
        ids = (record["prompt"] + record["output"])[:max_len]
        if len(ids) > len(record["prompt"]):
            examples.append((ids, len(record["prompt"])))
    return examples


def soft_label_path(shard: Path, top: int) -> Path:
    """Where draft/label.py keeps a shard's top-K soft labels."""
    return shard.with_name(f"{shard.name.split('.')[0]}.top{top}.pt")


def load_examples(folder: Path, max_len: int, soft_top: int = 0) -> list[Example]:
    """Every answer of the folder's shards, with the target's top-K soft labels
    from draft/label.py when `soft_top` is set."""
    examples = []
    for shard in sorted(folder.glob("*.jsonl")) + sorted(folder.glob("*.jsonl.gz")):
        answers = load_shard(shard, max_len)
        soft: list = [None] * len(answers)
        if soft_top:
            path = soft_label_path(shard, soft_top)
            if not path.exists():
                raise FileNotFoundError(f"{path} missing: run python -m draft.label "
                                        f"--data {folder} --top {soft_top}")
            soft = torch.load(path)
            if len(soft) != len(answers):
                raise ValueError(f"{path} labels {len(soft)} answers, {shard} has "
                                 f"{len(answers)}: relabel it")
        examples += [(ids, answer, labels)
                     for (ids, answer), labels in zip(answers, soft, strict=True)]
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


def collate(chosen: list[Example]):
    """Padded token ids, hard labels (-100 outside answers) and, when every
    example has them, the soft labels of the labelled positions in row order."""
    width = max(len(ids) for ids, _, _ in chosen)
    ids = torch.zeros(len(chosen), width, dtype=torch.int64)
    labels = torch.full((len(chosen), width), -100, dtype=torch.int64)
    for row, (tokens, answer, _) in enumerate(chosen):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        labels[row, answer : len(tokens)] = torch.tensor(tokens[answer:])
    soft = None
    if all(example[2] is not None for example in chosen):
        soft = (torch.cat([example[2][0] for example in chosen]).float(),
                torch.cat([example[2][1] for example in chosen]).long())
    return ids, labels, soft


def batches(examples: list[Example], size: int, rng: random.Random):
    if not examples:
        raise ValueError("no training examples (run draft/generate_data.py first)")
    size = min(size, len(examples))
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            yield collate([examples[i] for i in order[start : start + size]])


class Vocabulary:
    """The tokens the draft proposes from (draft_vocab.json): training scores
    only these, as specpage does at inference, so the vocabulary projection,
    most of the cost, shrinks with them."""

    def __init__(self, token_ids: list[int], vocab_size: int) -> None:
        self.ids = torch.tensor(token_ids)
        self.position = torch.full((vocab_size,), -1, dtype=torch.int64)
        self.position[self.ids] = torch.arange(len(token_ids))

    def logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ model.lm_head.weight[self.ids].T


def loss_and_agreement(model, ids, labels, vocabulary: Vocabulary,
                       soft: SoftLabels | None = None,
                       soft_weight: float = 0.0) -> tuple[torch.Tensor, float]:
    """Cross-entropy on answer tokens, mixed with `soft_weight` of the cross-
    entropy against the target's top-K distribution (renormalised over the
    draft's vocabulary) when soft labels are given; agreement is the draft's
    first choice against the token in the data. The vocabulary projection runs
    only where there is a label."""
    hidden = model.model(ids).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    mask = target != -100
    log_probs = torch.log_softmax(vocabulary.logits(model, hidden[mask]), dim=-1)
    wanted = vocabulary.position[target[mask]]  # -1: outside the draft's vocabulary
    loss = F.nll_loss(log_probs, wanted, ignore_index=-1)
    if soft is not None and soft_weight > 0:
        teacher_logprobs, teacher_ids = soft
        where = vocabulary.position[teacher_ids]
        teacher = torch.softmax(teacher_logprobs.masked_fill(where < 0, float("-inf")), dim=-1)
        teacher = teacher.nan_to_num(0.0)  # a row with no top-K token inside the vocabulary
        student = log_probs.gather(1, where.clamp(min=0))
        soft_loss = -(teacher * student).sum(-1).mean()
        loss = (1 - soft_weight) * loss + soft_weight * soft_loss
    agreement = float((log_probs.argmax(-1) == wanted).float().mean())
    return loss, agreement


def learning_rate(train: dict, step: int) -> float:
    """Linear warm-up, then cosine decay to `final_lr_fraction` at `steps`."""
    if step < train["warmup_steps"]:
        return train["learning_rate"] * (step + 1) / train["warmup_steps"]
    decay_steps = max(1, train["steps"] - train["warmup_steps"])
    progress = min(1.0, (step - train["warmup_steps"]) / decay_steps)
    floor = train["final_lr_fraction"]
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return train["learning_rate"] * (floor + (1 - floor) * cosine)


def save(model: torch.nn.Module, tokenizer_folder: Path, out: Path,
         vocabulary: list[int]) -> None:
    """fp16 HF checkpoint, the target's tokenizer files, and draft_vocab.json:
    the tokens the draft proposes from (specpage scores only those)."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_vocab.json").write_text(json.dumps({"token_ids": vocabulary}))
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    copy.half().save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=Path("draft/data"))
    parser.add_argument("--out", type=Path, default=Path("models/smollm2-draft"))
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--init", type=Path,
                        help="start from this draft checkpoint (a second stage) "
                             "instead of a new model")
    parser.add_argument("--max-minutes", type=float, help="stop early after this long")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out acceptance")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    config = tomllib.loads(args.config.read_text())
    if args.init is None and "model" not in config:
        parser.error(f"{args.config} has no [model] table: a later stage needs --init DRAFT")
    train = config["train"]
    torch.manual_seed(train["seed"])
    torch.set_num_threads(args.threads)
    rng = random.Random(train["seed"])
    target_folder = ensure_model("smollm2-135m")
    soft_top, soft_weight = train.get("soft_top", 0), train.get("soft_weight", 0.0)
    examples = load_examples(args.data, train["sequence_tokens"], soft_top)
    rng.shuffle(examples)
    held = max(1, int(len(examples) * train["held_out_fraction"]))
    validation, examples = examples[:held], examples[held:]
    if args.init:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    else:
        model = build_draft(target_folder, config["model"])
    # Every token of the target's answers it learns from, and end of sequence.
    eos = model.config.eos_token_id
    vocabulary = sorted({t for ids, answer, _ in examples for t in ids[answer:]}
                        | set(eos if isinstance(eos, list) else [eos]))
    scored = Vocabulary(vocabulary, model.config.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train["learning_rate"],
                                  weight_decay=train["weight_decay"])
    deadline = time.monotonic() + (args.max_minutes or math.inf) * 60
    step, seen, started = 0, 0, time.monotonic()
    stream = batches(examples, train["batch_sequences"], rng)
    while step < train["steps"] and time.monotonic() < deadline:
        ids, labels, soft = next(stream)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(train, step)
        loss, agreement = loss_and_agreement(model, ids, labels, scored, soft, soft_weight)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        seen += int((labels != -100).sum())
        if step % 50 == 0:
            rate = seen / (time.monotonic() - started)
            print(f"step {step}: loss {loss.item():.3f}, agreement {agreement:.3f}, "
                  f"{seen} answer tokens, {rate:.0f} tokens/s", file=sys.stderr)
        if step % train["checkpoint_every"] == 0:
            save(model, target_folder, args.out, vocabulary)
    model.eval()
    with torch.no_grad():
        losses, agreements = [], []
        for example in validation:  # hard labels: comparable across runs
            ids, labels, _ = collate([example])
            loss, agreement = loss_and_agreement(model, ids, labels, scored)
            losses.append(float(loss))
            agreements.append(agreement)
    save(model, target_folder, args.out, vocabulary)
    result = {"steps": step, "answer_tokens_seen": seen, "examples": len(examples),
              "validation_loss": sum(losses) / len(losses),
              "validation_perplexity": math.exp(sum(losses) / len(losses)),
              "validation_agreement": sum(agreements) / len(agreements),
              "out": str(args.out)}
    print(json.dumps(result), file=sys.stderr)
    if not args.no_eval:
        from draft.evaluate import held_out_acceptance

        result["held_out"] = held_out_acceptance(args.out, k=4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
