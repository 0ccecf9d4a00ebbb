"""Tiny random EAGLE-3 heads, written in the vLLM/SGLang llama_eagle3 layout,
and a reference of what a head computes, in plain torch from the
checkpoint's own tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specpage.models.config import ARCHITECTURE
from specpage.models.eagle3 import Eagle3Config, Eagle3Head, checkpoint_tensors

HEAD_FILE = "model.safetensors"


def tiny_head(folder: Path, target_config, seed: int = 0, draft_vocab: list[int] | None = None,
              scale: float = 1.0, **overrides) -> dict:
    """A random head for a transformers target's config; returns its config.json.
    draft_vocab: the target ids it proposes from (d2t offsets), else all."""
    vocab = draft_vocab or list(range(target_config.vocab_size))
    raw = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": target_config.hidden_size,
        "intermediate_size": 80,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "max_position_embeddings": target_config.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": target_config.vocab_size,
        "draft_vocab_size": len(vocab),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    raw.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_dict(raw, "test"))
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0, scale / math.sqrt(param.shape[-1]))
        head.draft_to_target = torch.tensor(sorted(vocab), dtype=torch.int64)
    save_file(checkpoint_tensors(head), folder / HEAD_FILE)
    return raw


def reference_proposals(folder: Path, hf_target, tokens: list[int]) -> list[int]:
    """What the head proposes first after each position p of tokens, read
    from transformers' hidden states: argmax over the target vocabulary of
    the head at p (features at p, embedding of token p + 1), i.e. its guess
    for token p + 2; one per p in 0 .. len(tokens) - 2."""
    raw = json.loads((folder / "config.json").read_text())
    w = load_file(folder / HEAD_FILE)
    layers = hf_target.config.num_hidden_layers
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or [2, layers // 2, layers - 3]
    with torch.no_grad():
        out = hf_target(torch.tensor([tokens]), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i][0] for i in sorted(ids)], -1)[:-1]
        embeds = hf_target.model.embed_tokens(torch.tensor(tokens[1:]))
        eps = raw["rms_norm_eps"]

        def norm(x, name):
            return w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

        hidden = features @ w["fc.weight"].T
        residual = hidden
        x = torch.cat([norm(embeds, "midlayer.input_layernorm.weight"),
                       norm(hidden, "midlayer.hidden_norm.weight")], -1)
        heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
        d = raw["hidden_size"] // heads
        n = x.shape[0]
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, d).transpose(0, 1)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, d).transpose(0, 1)
        inv = 1.0 / raw["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
        angles = torch.arange(n).float()[:, None] * inv[None, :]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

        def rope(t):
            return t * cos + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * sin

        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(heads // kv_heads, 0) for t in (k, v))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        residual = residual + attn.transpose(0, 1).reshape(n, -1) @ w[
            "midlayer.self_attn.o_proj.weight"].T
        h = norm(residual, "midlayer.post_attention_layernorm.weight")
        gate = h @ w["midlayer.mlp.gate_proj.weight"].T
        up = h @ w["midlayer.mlp.up_proj.weight"].T
        residual = residual + (torch.nn.functional.silu(gate) * up) @ w[
            "midlayer.mlp.down_proj.weight"].T
        scores = norm(residual, "norm.weight") @ w["lm_head.weight"].T
        d2t = w["d2t"]
        best = scores.argmax(-1)
        return (best + d2t[best]).tolist()
