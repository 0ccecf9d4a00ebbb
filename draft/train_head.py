"""Train an EAGLE-3 head for SmolLM2-135M-Instruct on CPU, from the target's
own answers (the JSONL shards of draft/generate_data.py), with the target's
hidden states captured by specpage's own runner (ModelRunner with a
LayerTap) as it trains: nothing is stored but the head.

Trained as it drafts (training-time test, as EAGLE-3 is): at each answer
position p the head reads the target's features at p and the embedding of
token p + 1 and learns token p + 2; then, --depth proposals deep, it reads
its own previous output and the embedding of the next token of the answer
and learns the one after, attending to exactly the K/V it would see when
drafting (ttt_forward). The loss is the cross-entropy over its draft
vocabulary (the most frequent answer tokens) at every depth, depth j
weighted 0.8 ** j, against the answer's next token, or with --soft-labels
against the target's own next-token distribution there, at the positions
whose greedy token the head can propose (the soft labels EAGLE-3's
training uses). --init starts from a trained head (its weights and draft
vocabulary) with a fresh optimiser. It checkpoints (the head in the llama_eagle3 layout, plus the
optimiser, so a run resumes) every --save-every steps; evaluate with
`python -m draft.evaluate --draft OUT --k K` (per-token acceptance on the
held-out benchmark prompts).

    python -m draft.train_head --data draft/data --out /tmp/head
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
from safetensors.torch import load_file, save_file

from draft.train import load_shard
from specpage.core.span import Span
from specpage.executor.model_runner import ModelRunner
from specpage.layers.fused import rms_norm_ref
from specpage.layers.rope import apply_rope, cos_sin
from specpage.models.config import ARCHITECTURE
from specpage.models.decoder import LayerTap
from specpage.models.eagle3 import Eagle3Config, Eagle3Head, checkpoint_tensors
from specpage.models.fetch import ensure_model
from specpage.models.loader import auto_dtype, load_model

BLOCK = 16
MAX_LEN = 384  # positions per example; the answers are at most 192 tokens
WARMUP = 100  # steps of linear warm-up before the cosine decay
DEPTH_DECAY = 0.8  # weight of depth j's loss: 0.8 ** j


def head_config(target_raw: dict, draft_vocab: int, target_layers: int,
                taps: tuple[int, ...] | None = None) -> dict:
    """The head's config.json; taps: the target layers whose input it reads
    (low, middle, high), by default EAGLE-3's 2, L / 2 and L - 3."""
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "rope_theta", "vocab_size", "max_position_embeddings", "head_dim")
    raw = {k: target_raw[k] for k in keep if k in target_raw}
    raw.update(architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1,
               intermediate_size=target_raw["intermediate_size"], draft_vocab_size=draft_vocab,
               tie_word_embeddings=False, torch_dtype="float32",
               eagle_aux_hidden_state_layer_ids=list(
                   taps or (2, target_layers // 2, target_layers - 3)))
    return raw


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # the reference RMSNorm: the native kernels have no backward
    return rms_norm_ref(x, norm.weight, norm.eps)


def head_logits(head: Eagle3Head, prenorm: torch.Tensor) -> torch.Tensor:
    """[rows, hidden] -> [rows, draft vocabulary], differentiably."""
    return F.linear(_norm(head.norm, prenorm), head.lm_head.weight)


def _layer_inputs(head: Eagle3Head, embeds: torch.Tensor, hidden: torch.Tensor,
                  positions: torch.Tensor):
    """(residual, q [heads, n, d], k and v [kv_heads, n, d]) of the head's
    layer, as Eagle3Head.forward makes them."""
    n = embeds.shape[0]
    cos, sin = cos_sin(head.inv_freq, positions, embeds.dtype)
    normed = _norm(head.hidden_norm, hidden)
    residual = normed if head.config.norm_before_residual else hidden
    x = torch.cat([_norm(head.input_layernorm, embeds), normed], dim=-1)
    q_size, kv_size = head.num_heads * head.head_dim, head.num_kv_heads * head.head_dim
    q, k, v = F.linear(x, head.qkv_proj.weight).split([q_size, kv_size, kv_size], dim=-1)
    q = apply_rope(q.view(n, head.num_heads, head.head_dim), cos, sin).transpose(0, 1)
    k = apply_rope(k.view(n, head.num_kv_heads, head.head_dim), cos, sin).transpose(0, 1)
    v = v.view(n, head.num_kv_heads, head.head_dim).transpose(0, 1)
    return residual, q, k, v


def _layer_output(head: Eagle3Head, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    n = residual.shape[0]
    residual = residual + F.linear(attn.transpose(0, 1).reshape(n, -1), head.o_proj.weight)
    gate, up = F.linear(_norm(head.post_attention_layernorm, residual),
                        head.gate_up_proj.weight).chunk(2, dim=-1)
    return residual + F.linear(F.silu(gate) * up, head.down_proj.weight)


def ttt_forward(head: Eagle3Head, embeds: torch.Tensor, hidden: torch.Tensor,
                depth: int) -> list[torch.Tensor]:
    """The head unrolled `depth` proposals deep over every anchor at once,
    differentiably, as it drafts at run time (training-time test).

    Anchor p (0 .. n - 1) is a position whose target features are known
    (`hidden[p]` = fc(features at p)); `embeds[p]` embeds token p + 1.
    Depth 0 at anchor p is the head at position p: its output predicts
    token p + 2, the first proposal. Depth j > 0 is the head at position
    p + j, fed its own depth j - 1 output and the embedding of token
    p + j + 1, and attends to what it would see when drafting: depth 0's
    K/V at anchors <= p and its own deeper K/V of the same anchor.
    Returns the pre-norm output of each depth, depth j over anchors
    0 .. n - 1 - j ([n - j, hidden]); `embeds` has n rows."""
    n = hidden.shape[0]
    group = head.num_heads // head.num_kv_heads
    scale = head.head_dim**-0.5
    anchors = torch.arange(n)
    outs: list[torch.Tensor] = []
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []  # (k, v) per depth, [heads, rows, d]
    for j in range(depth):
        rows = n - j
        residual, q, k, v = _layer_inputs(head, embeds[j : j + rows],
                                          hidden if j == 0 else outs[-1][:rows],
                                          anchors[:rows] + j)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        keys.append((k, v))
        k0, v0 = keys[0]
        scores = torch.einsum("hqd,hkd->hqk", q, k0) * scale  # depth 0, anchors <= p
        scores = scores.masked_fill(anchors[None, :] > anchors[:rows, None], float("-inf"))
        own = [(q * kj[:, :rows]).sum(-1, keepdim=True) * scale for kj, _ in keys[1:]]
        weights = torch.cat([scores, *own], dim=-1).softmax(-1)
        attn = weights[..., :n] @ v0
        for i, (_, vj) in enumerate(keys[1:]):
            attn = attn + weights[..., n + i : n + i + 1] * vj[:, :rows]
        outs.append(_layer_output(head, residual, attn))
    return outs


def target_labels(target_logits: torch.Tensor, vocab: torch.Tensor,
                  to_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From the target's logits [rows, vocab]: each row's greedy token as a
    draft id (-1 where the draft vocabulary lacks it) and the target's
    distribution over the draft vocabulary [rows, draft vocab]."""
    return to_draft[target_logits.argmax(-1)], target_logits[:, vocab].float().softmax(-1)


def depth_loss(logits: torch.Tensor, labels: torch.Tensor,
               probs: torch.Tensor | None) -> torch.Tensor:
    """The mean cross-entropy of the head's logits over the rows whose label
    is a draft id: against the target's distribution `probs` where given,
    else against the label."""
    if probs is None:
        return F.cross_entropy(logits, labels, ignore_index=-1)
    valid = labels >= 0
    return -(probs[valid] * logits[valid].log_softmax(-1)).sum(-1).mean()


def save(head: Eagle3Head, raw: dict, out: Path, opt: torch.optim.Optimizer, step: int,
         keep: bool) -> None:
    """The head and optimiser in `out` (resumable); with `keep`, the head
    alone also in out/steps/STEP, for acceptance against training tokens."""
    for folder in [out, out / "steps" / str(step)] if keep else [out]:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(raw, indent=1))
        save_file(checkpoint_tensors(head), folder / "model.safetensors")
    torch.save({"optimizer": opt.state_dict(), "step": step}, out / "optimizer.pt")


def export(trained: Path, out: Path) -> None:
    """The trained head (its float tensors in bf16) and its config, to ship."""
    raw = json.loads((trained / "config.json").read_text())
    raw["torch_dtype"] = "bfloat16"
    tensors = {name: t.to(torch.bfloat16) if t.is_floating_point() else t
               for name, t in load_file(trained / "model.safetensors").items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=1) + "\n")
    save_file(tensors, out / "model.safetensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=Path("draft/snapshots"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--save-every", type=int, default=250)
    parser.add_argument("--keep-every", type=int, default=1000,
                        help="also keep the head of every N-th step in OUT/steps/N")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--taps", type=int, nargs=3, default=None, metavar="LAYER",
                        help="the three target layers whose input the head reads "
                             "(default: 2, L / 2, L - 3; a resumed or --init head keeps its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--depth", type=int, default=4,
                        help="proposals unrolled per anchor (training-time test)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction,
                        default=auto_dtype(torch.device("cpu")) == torch.bfloat16,
                        help="bf16 autocast for the head and bf16 target features "
                        "(default: where the CPU computes bf16 natively)")
    parser.add_argument("--soft-labels", action="store_true",
                        help="learn the target's distribution instead of the answer's next token")
    parser.add_argument("--init", type=Path, default=None,
                        help="start from this head (weights and draft vocabulary), "
                        "unless OUT has a checkpoint to resume")
    parser.add_argument("--export", type=Path, default=None,
                        help="write OUT's head in bf16 into this folder, and train nothing")
    args = parser.parse_args()
    if args.export:
        export(args.out, args.export)
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    folder = ensure_model("smollm2-135m")
    target = load_model(folder, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    runner = ModelRunner(target, MAX_LEN // BLOCK, BLOCK)
    # each distinct answer once (the same greedy request answers the same)
    examples = list({tuple(ids): (ids, start) for shard in sorted(args.data.glob("*.jsonl*"))
                     for ids, start in load_shard(shard, MAX_LEN)}.values())
    rng = random.Random(args.seed)
    rng.shuffle(examples)
    resume = args.out if (args.out / "optimizer.pt").is_file() else args.init
    initial = load_model(resume, dtype=torch.float32).model if resume else None
    taps = tuple(args.taps) if args.taps else None
    if initial is not None:
        vocab = initial.draft_to_target.tolist()
        taps = initial.config.layers_of(target.config.num_layers)
    else:
        counts = Counter(t for ids, start in examples for t in ids[start:])
        vocab = sorted(t for t, _ in counts.most_common(args.draft_vocab))
    raw = head_config(json.loads((folder / "config.json").read_text()), len(vocab),
                      target.config.num_layers, taps)
    config = Eagle3Config.from_dict(raw, "head")
    layers = config.layers_of(target.config.num_layers)
    head = Eagle3Head(config)
    embed = target.model.embed_tokens.weight.detach().float()
    to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.int64)
    vocab_ids = torch.tensor(vocab)
    to_draft[vocab_ids] = torch.arange(len(vocab))
    with torch.no_grad():
        head.draft_to_target = vocab_ids
        head.lm_head.weight.copy_(embed[vocab_ids])  # SmolLM2 ties its head
        head.fc.weight.copy_(torch.cat([torch.eye(config.layer.hidden_size)] * 3, 1) / 3)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    step = 0
    if initial is not None:
        head.load_state_dict(initial.state_dict())
    if resume == args.out:
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
            target_logits = runner.forward(
                [Span(ids, 0, table, num_logits=len(ids) if args.soft_labels else 1)], tap)
        features = torch.cat(tap.states, -1)[:-2].float()  # anchors 0 .. n - 1
        n = features.shape[0]
        lr = args.lr * min(1.0, (step + 1) / WARMUP) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        tokens = torch.tensor(ids)
        embeds = embed[tokens[1 : n + 1]]
        if args.soft_labels:  # row r of the target's logits: its distribution of token r + 1
            wanted, probs = target_labels(target_logits[1:], vocab_ids, to_draft)
        else:
            wanted, probs = to_draft[tokens[2:]], None  # -1: not drafted
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            outs = ttt_forward(head, embeds, F.linear(features, head.fc.weight),
                               min(args.depth, n))
            losses, first = [], None
            for j, out in enumerate(outs):
                rows = out.shape[0]  # anchors p, learning token p + 2 + j
                labels = wanted[j : j + rows].clone()
                labels[: max(0, answer - 2 - j)] = -1  # learn on the answer only
                logits = head_logits(head, out).float()
                if bool((labels >= 0).any()):
                    losses.append(DEPTH_DECAY**j * depth_loss(
                        logits, labels, None if probs is None else probs[j : j + rows]))
                if first is None:
                    first = (logits, labels)
        loss = sum(losses) / sum(DEPTH_DECAY**j for j in range(len(losses)))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        logits, labels = first
        valid = labels >= 0
        tokens_seen += int(valid.sum())
        window.append(float((logits.argmax(-1)[valid] == labels[valid]).float().mean()))
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f} top1 {sum(window) / len(window):.3f} "
                  f"tokens {tokens_seen} lr {lr:.2e} {time.time() - started:.0f}s",
                  file=log, flush=True)
            window = []
        if step % args.save_every == 0 or step == args.steps:
            save(head, raw, args.out, opt, step, step % args.keep_every == 0)


if __name__ == "__main__":
    main()
