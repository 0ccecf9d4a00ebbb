"""An EAGLE-3 draft head: one decoder layer that reads the target's own
hidden states, in the checkpoint layout vLLM's and SGLang's ``llama_eagle3``
loaders read (so a head trained elsewhere loads here, and ours load there).

``config.json``: a Llama config with ``architectures:
["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, optionally
``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` (top level or in
``eagle_config``) and ``norm_before_residual``. Weights: ``fc.weight``
[hidden, 3 * target_hidden], ``midlayer.*`` (one Llama layer whose q/k/v
read 2 * hidden: the normed token embedding, then the normed hidden state;
``midlayer.hidden_norm`` and ``midlayer.input_layernorm`` norm them),
``norm``, ``lm_head`` [draft_vocab, hidden], ``d2t`` (offsets: the target id
of draft token i is i + d2t[i]) and ``t2d`` (a mask over the target's
vocabulary; optional, not read). The embedding is the target's unless the
checkpoint stores ``embed_tokens.weight``.

Alignment: the head at position p reads the target's features at p (the
residual stream entering three of its layers, projected by ``fc``) and the
embedding of token p + 1, and predicts token p + 2. Deeper proposals feed
the head's own pre-norm output in place of ``fc(features)``, as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specpage.attention.backend import AttentionBackend, AttentionMetadata
from specpage.layers import fused
from specpage.layers.linear import Linear
from specpage.layers.norm import RMSNorm
from specpage.layers.rope import cos_sin, inverse_frequencies
from specpage.models.config import ModelConfig, ModelLoadError

NUM_FEATURE_LAYERS = 3  # low, middle and high: what fc reads


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the one decoder layer's shape; vocab_size is the target's
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...] | None  # target layers tapped; None: vLLM's default
    norm_before_residual: bool

    @property
    def max_position(self) -> int:
        return self.layer.max_position

    def layers_of(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose input (the residual stream entering
        them: HF's hidden_states[i]) fc reads, in layer order. vLLM's
        default is 2, L / 2 and L - 3."""
        ids = self.feature_layers or (2, target_layers // 2, target_layers - 3)
        if len(ids) != NUM_FEATURE_LAYERS or not all(0 <= i < target_layers for i in ids):
            raise ModelLoadError(f"EAGLE-3 head reads target layers {list(ids)}; the target "
                                 f"has {target_layers} (need {NUM_FEATURE_LAYERS} ids below it)")
        return tuple(sorted(ids))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> Eagle3Config:
        layer = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]}, source)
        if raw.get("num_hidden_layers", 1) != 1:
            raise ModelLoadError(f"{source}: an EAGLE-3 head has one layer, not "
                                 f"{raw['num_hidden_layers']}")
        eagle = raw.get("eagle_config") or {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
            "eagle_aux_hidden_state_layer_ids")
        return cls(
            layer=layer,
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
            target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
            feature_layers=tuple(int(i) for i in ids) if ids else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        c = config.layer
        h, d = c.hidden_size, c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, d
        self.fc = Linear(NUM_FEATURE_LAYERS * config.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.qkv_proj = Linear(2 * h, (c.num_heads + 2 * c.num_kv_heads) * d, bias=c.qkv_bias)
        self.o_proj = Linear(c.num_heads * d, h, bias=c.o_bias)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.gate_up_proj = Linear(h, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = Linear(c.intermediate_size, h, bias=c.mlp_bias)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = Linear(h, config.draft_vocab_size, bias=False)
        self.embed_tokens: nn.Embedding | None = None  # the target's, unless stored
        # target id of each draft-vocabulary row: i + d2t[i]
        self.register_buffer("draft_to_target",
                             torch.arange(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("inv_freq", inverse_frequencies(c.rope, d), persistent=False)

    def forward(
        self,
        embeds: torch.Tensor,  # [num_tokens, hidden]: of each position's next token
        hidden: torch.Tensor,  # [num_tokens, hidden]: fc(features), or the head's own output
        positions: torch.Tensor,  # [num_tokens] int64
        cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        outputs: tuple[torch.Tensor, AttentionMetadata] | None = None,
    ) -> torch.Tensor:
        """The layer's pre-norm output [num_tokens, hidden]; writes its K/V
        at every position. outputs: (rows, their metadata as spans of one
        query each): the output at those rows only [len(rows), hidden], the
        other positions stopping once their K/V is written."""
        rope = cos_sin(self.inv_freq, positions, embeds.dtype)
        normed = self.hidden_norm(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        # the target layers' fused kernels (layers/fused.py), where they build
        q, k, v = fused.rope_qk(self.qkv_proj(x), *rope, self.num_heads, self.num_kv_heads)
        backend.write_kv(cache, k, v, meta)
        if outputs is not None:
            rows, meta = outputs
            q, residual = q[rows], residual[rows]
        attn = backend.attend(q, cache, meta, self.head_dim**-0.5)
        residual, normed = self.post_attention_layernorm.after_add(self.o_proj(attn), residual)
        return residual + self.down_proj(fused.silu_and_mul(self.gate_up_proj(normed)))

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> fp32 logits over the target's vocabulary
        [rows, vocab]: -inf outside the draft vocabulary."""
        scores = self.lm_head(self.norm(prenorm)).float()
        if self.config.draft_vocab_size == self.config.layer.vocab_size:
            identity = bool((self.draft_to_target == torch.arange(
                scores.shape[1], device=scores.device)).all())
            if identity:
                return scores
        full = scores.new_full((scores.shape[0], self.config.layer.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_to_target, scores)


@dataclass(frozen=True)
class LoadedHead:
    model: Eagle3Head
    config: Eagle3Config
    folder: Path
    identity: bytes  # digest of the config and the weight files' headers and sizes
    quantization: str = "none"  # what models/quant_load applied to its linears

    @property
    def dtype(self) -> torch.dtype:
        """What it computes in (its norms' dtype: its linears may be int4)."""
        return self.model.norm.weight.dtype


_UNFUSED = {  # our parameter -> the checkpoint's tensors concatenated into it
    "qkv_proj": ("midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj",
                 "midlayer.self_attn.v_proj"),
    "gate_up_proj": ("midlayer.mlp.gate_proj", "midlayer.mlp.up_proj"),
    "o_proj": ("midlayer.self_attn.o_proj",),
    "down_proj": ("midlayer.mlp.down_proj",),
    "hidden_norm": ("midlayer.hidden_norm",),
    "input_layernorm": ("midlayer.input_layernorm",),
    "post_attention_layernorm": ("midlayer.post_attention_layernorm",),
    "fc": ("fc",),
    "norm": ("norm",),
    "lm_head": ("lm_head",),
}


def load_head(folder: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
              device: torch.device, identity: bytes) -> LoadedHead:
    """A head from its folder's config and its checkpoint's tensors."""
    source = str(folder / "config.json")
    config = Eagle3Config.from_dict(json.loads((folder / "config.json").read_text()), source)
    tensors = {name.removeprefix("model."): t for name, t in tensors.items()}

    def take(name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise ModelLoadError(f"{folder}: EAGLE-3 weights lack tensor {name!r}") from None

    c = config.layer
    biases = {"qkv_proj": c.qkv_bias, "o_proj": c.o_bias, "gate_up_proj": c.mlp_bias,
              "down_proj": c.mlp_bias}
    state = {}
    for ours, parts in _UNFUSED.items():
        for kind in ("weight", "bias") if biases.get(ours) else ("weight",):
            state[f"{ours}.{kind}"] = torch.cat([take(f"{p}.{kind}") for p in parts])
    with torch.device("meta"):
        model = Eagle3Head(config)
    state["draft_to_target"] = _draft_to_target(tensors.get("d2t"), config, folder)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = torch.empty(0)  # the meta buffer; set for real below
    model = model.to(device=device, dtype=dtype).eval()
    model.inv_freq = inverse_frequencies(c.rope, c.head_dim).to(device)
    if "embed_tokens.weight" in tensors:
        model.embed_tokens = nn.Embedding.from_pretrained(
            tensors["embed_tokens.weight"].to(device=device, dtype=dtype))
    _check_shapes(model, config, folder)
    return LoadedHead(model, config, folder, identity)


def _draft_to_target(d2t: torch.Tensor | None, config: Eagle3Config,
                     folder: Path) -> torch.Tensor:
    rows = torch.arange(config.draft_vocab_size, dtype=torch.int64)
    if d2t is None:
        if config.draft_vocab_size != config.layer.vocab_size:
            raise ModelLoadError(f"{folder}: a reduced draft vocabulary "
                                 f"({config.draft_vocab_size} tokens) needs d2t")
        return rows
    ids = rows + d2t.to(torch.int64).flatten()
    if ids.numel() != config.draft_vocab_size or not bool(
        ((ids >= 0) & (ids < config.layer.vocab_size)).all()
    ) or ids.unique().numel() != ids.numel():
        raise ModelLoadError(f"{folder}: d2t must map {config.draft_vocab_size} draft tokens "
                             f"to distinct ids in 0..{config.layer.vocab_size - 1}")
    return ids


def _check_shapes(model: Eagle3Head, config: Eagle3Config, folder: Path) -> None:
    expected = {"fc": (config.layer.hidden_size, NUM_FEATURE_LAYERS * config.target_hidden_size),
                "lm_head": (config.draft_vocab_size, config.layer.hidden_size)}
    for name, shape in expected.items():
        actual = tuple(getattr(model, name).weight.shape)
        if actual != shape:
            raise ModelLoadError(f"{folder}: {name} is {actual}, config says {shape}")


def checkpoint_tensors(model: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's weights under the checkpoint's names (q/k/v and gate/up
    split again, d2t as offsets, t2d as a mask), for saving."""
    c = model.config.layer
    sizes = {"qkv_proj": [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                          c.num_kv_heads * c.head_dim],
             "gate_up_proj": [c.intermediate_size, c.intermediate_size]}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        ours, _, kind = name.rpartition(".")
        if ours not in _UNFUSED:
            continue
        parts = _UNFUSED[ours]
        pieces = tensor.split(sizes[ours]) if ours in sizes else [tensor]
        for part, piece in zip(parts, pieces, strict=True):
            out[f"{part}.{kind}"] = piece.detach().contiguous()
    ids = model.draft_to_target.cpu()
    out["d2t"] = ids - torch.arange(ids.numel())
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    return out
