"""Train an EAGLE-3 head for SmolLM2-135M-Instruct on CPU, from the target's
own answers (the JSONL shards of draft/generate_data.py), with the target's
hidden states captured by specpage's own runner (ModelRunner with a
LayerTap) as it trains: nothing is stored but the head.

Teacher-forced, one step deep: at each answer position p the head reads the
target's features at p and the embedding of token p + 1 and learns token
p + 2 (cross-entropy over its draft vocabulary, the most frequent answer
tokens). It checkpoints (the head in the llama_eagle3 layout, plus the
optimiser, so a run resumes) every --save-every steps; evaluate with
`python -m draft.evaluate --draft OUT --k K` (per-token acceptance on the
held-out benchmark prompts).

    nice -n 10 python -m draft.train_head --data draft/snapshots --out /tmp/head
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from draft.train import load_shard
from specpage.model_runner import ModelRunner, SeqSpan
from specpage.models.decoder import LayerTap
from specpage.models.eagle3 import ARCHITECTURE, Eagle3Config, Eagle3Head, checkpoint_tensors
from specpage.models.fetch import ensure_model
from specpage.models.loader import load_model
from specpage.models.rope import apply_rope, cos_sin

BLOCK = 16
MAX_LEN = 384  # positions per example; the answers are at most 192 tokens
WARMUP = 100  # steps of linear warm-up before the cosine decay


def head_config(target_raw: dict, draft_vocab: int, target_layers: int) -> dict:
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "rope_theta", "vocab_size", "max_position_embeddings", "head_dim")
    raw = {k: target_raw[k] for k in keep if k in target_raw}
    raw.update(architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1,
               intermediate_size=target_raw["intermediate_size"], draft_vocab_size=draft_vocab,
               tie_word_embeddings=False, torch_dtype="float32",
               eagle_aux_hidden_state_layer_ids=[2, target_layers // 2, target_layers - 3])
    return raw


def train_forward(head: Eagle3Head, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Head.forward with causal attention in plain torch (differentiable);
    positions 0 .. n - 1. Returns the pre-norm output [n, hidden]."""
    n = embeds.shape[0]
    rope = cos_sin(head.inv_freq, torch.arange(n), embeds.dtype)
    normed = head.hidden_norm(hidden)
    residual = normed if head.config.norm_before_residual else hidden
    x = torch.cat([head.input_layernorm(embeds), normed], dim=-1)
    q_size, kv_size = head.num_heads * head.head_dim, head.num_kv_heads * head.head_dim
    q, k, v = F.linear(x, head.qkv_proj.weight).split([q_size, kv_size, kv_size], dim=-1)
    q = apply_rope(q.view(n, head.num_heads, head.head_dim), *rope).transpose(0, 1)
    k = apply_rope(k.view(n, head.num_kv_heads, head.head_dim), *rope).transpose(0, 1)
    v = v.view(n, head.num_kv_heads, head.head_dim).transpose(0, 1)
    group = head.num_heads // head.num_kv_heads
    attn = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 0),
                                          v.repeat_interleave(group, 0), is_causal=True)
    residual = residual + F.linear(attn.transpose(0, 1).reshape(n, -1), head.o_proj.weight)
    gate, up = F.linear(head.post_attention_layernorm(residual),
                        head.gate_up_proj.weight).chunk(2, dim=-1)
    return residual + F.linear(F.silu(gate) * up, head.down_proj.weight)


def save(head: Eagle3Head, raw: dict, out: Path, opt: torch.optim.Optimizer, step: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    save_file(checkpoint_tensors(head), out / "model.safetensors")
    torch.save({"optimizer": opt.state_dict(), "step": step}, out / "optimizer.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=Path("draft/snapshots"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--save-every", type=int, default=250)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    folder = ensure_model("smollm2-135m")
    target = load_model(folder)
    runner = ModelRunner(target, MAX_LEN // BLOCK, BLOCK)
    examples = [e for shard in sorted(args.data.glob("*.jsonl*"))
                for e in load_shard(shard, MAX_LEN)]
    rng = random.Random(args.seed)
    rng.shuffle(examples)
    counts = Counter(t for ids, start in examples for t in ids[start:])
    vocab = sorted(t for t, _ in counts.most_common(args.draft_vocab))
    raw = head_config(json.loads((folder / "config.json").read_text()), len(vocab),
                      target.config.num_layers)
    config = Eagle3Config.from_dict(raw, "head")
    layers = config.layers_of(target.config.num_layers)
    head = Eagle3Head(config)
    embed = target.model.embed_tokens.weight.detach()
    to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.int64)
    to_draft[torch.tensor(vocab)] = torch.arange(len(vocab))
    with torch.no_grad():
        head.draft_to_target = torch.tensor(vocab)
        head.lm_head.weight.copy_(embed[torch.tensor(vocab)])  # SmolLM2 ties its head
        head.fc.weight.copy_(torch.cat([torch.eye(config.layer.hidden_size)] * 3, 1) / 3)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    step = 0
    if (args.out / "optimizer.pt").is_file():
        resumed = load_model(args.out)
        head.load_state_dict(resumed.model.state_dict())
        saved = torch.load(args.out / "optimizer.pt")
        opt.load_state_dict(saved["optimizer"])
        step = saved["step"]
    table = list(range(MAX_LEN // BLOCK))
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "train.log").open("a")
    started, window, tokens_seen = time.time(), [], 0
    while step < args.steps:
        ids, answer = examples[step % len(examples)]
        tap = LayerTap(layers)
        with torch.no_grad():
            runner.forward([SeqSpan(ids, 0, table, num_logits=1)], tap)
        features = torch.cat(tap.states, -1)[:-2]  # positions 0 .. n - 3
        nxt = torch.tensor(ids[1:-1])  # token p + 1, embedded
        labels = to_draft[torch.tensor(ids[2:])]  # token p + 2, -1 outside the vocabulary
        labels[: max(0, answer - 2)] = -1  # learn on the answer only
        lr = args.lr * min(1.0, (step + 1) / WARMUP) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        out = train_forward(head, embed[nxt], head.fc(features))
        logits = head.lm_head(head.norm(out))
        loss = F.cross_entropy(logits, labels, ignore_index=-1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        valid = labels >= 0
        tokens_seen += int(valid.sum())
        window.append(float((logits.argmax(-1)[valid] == labels[valid]).float().mean()))
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f} top1 {sum(window) / len(window):.3f} "
                  f"tokens {tokens_seen} lr {lr:.2e} {time.time() - started:.0f}s",
                  file=log, flush=True)
            window = []
        if step % args.save_every == 0 or step == args.steps:
            save(head, raw, args.out, opt, step)


if __name__ == "__main__":
    main()
