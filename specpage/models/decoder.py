"""Decoder-only transformer of the Llama family (Llama 2/3, SmolLM, TinyLlama,
Mistral) and Qwen2 (bias on q/k/v), written against the paged-attention
interface. Q/K/V and gate/up projections are fused into one matmul each."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpage.attention.backend import AttentionBackend, AttentionMetadata
from specpage.models.config import ModelConfig
from specpage.models.rope import apply_rope, cos_sin, inverse_frequencies


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 and cast back before the weight, as HF does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


# On CPU, BLAS is slow for a few rows against a large weight: F.linear packs
# the weight as if for a big product, and the speed of W @ x.T depends on the
# row count. Measured on 2 AVX2 cores with the weights streamed from memory
# (SmolLM2-135M's layers, ms for all 30): 1 row 27.5, 2: 20.0, 3: 25.8, 4: 20.0,
# 8: 37.0, 12: 54.4, 16: 39.3, 24: 55.4, 31: 107, 32: 57.8. So a few rows are
# padded with zero rows to the nearest fast count; one row against the
# vocabulary projection is faster still as x @ W.T held contiguous
# (DecoderModel._transposed_head).
FEW_ROWS = 32


def padded_rows(rows: int) -> int:
    if rows in (1, 3):
        return rows + 1
    if 9 <= rows <= 16:
        return 16
    if rows > 16:
        return -(-rows // 8) * 8
    return rows


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.device.type != "cpu" or x.shape[0] > FEW_ROWS:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    y = (weight @ x.contiguous().T).T[:rows]  # x.T transposed, as BLAS is fast at
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """nn.Linear (same parameters) with the few-rows path on CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_rows_linear(x, self.weight, self.bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, d
        )
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.qkv_proj = Linear(h, (config.num_heads + 2 * config.num_kv_heads) * d,
                                  bias=config.qkv_bias)
        self.o_proj = Linear(config.num_heads * d, h, bias=config.o_bias)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.gate_up_proj = Linear(h, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, h, bias=config.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [num_tokens, head_dim]
        cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        n = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(self.input_layernorm(x))
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), *rope)
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), *rope)
        backend.write_kv(cache, k, v.view(n, self.num_kv_heads, self.head_dim), meta)
        attn = backend.attend(q, cache, meta, self.head_dim**-0.5)
        x = x + self.o_proj(attn)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LayerTap:
    """Collects the residual stream entering some layers (HF's
    hidden_states[i] for layer i) during a forward, in layer order: the
    features an EAGLE-3 head reads (models/eagle3.py)."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.layers = layers
        self.states: list[torch.Tensor] = []  # each [num_tokens, hidden]

    def see(self, index: int, x: torch.Tensor) -> None:
        self.states.extend([x] * self.layers.count(index))  # a layer may be named twice


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._head_t: torch.Tensor | None = None
        # A draft may propose from part of the vocabulary only: its projection
        # then reads only those rows (see restrict_output_vocab).
        self.output_vocab: torch.Tensor | None = None
        self._head_rows: torch.Tensor | None = None
        self.register_buffer(
            "inv_freq", inverse_frequencies(config.rope, config.head_dim), persistent=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        caches: list[torch.Tensor],  # one [2, num_blocks, block_size, kv_heads, d] per layer
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_index: torch.Tensor,  # [num_logits] int64, rows of the tokens to score
        tap: LayerTap | None = None,
    ) -> torch.Tensor:
        """Logits [num_logits, vocab] in fp32 for the tokens in logits_index."""
        x = self.embed_tokens(input_ids)
        rope = cos_sin(self.inv_freq, positions, x.dtype)
        for index, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            if tap is not None:
                tap.see(index, x)
            x = layer(x, rope, cache, meta, backend)
        x = self.norm(x[logits_index])
        head = self._head()
        if x.shape[0] == 1 and head.device.type == "cpu":
            logits = (x @ self._transposed_head(head)).float()
        else:
            logits = few_rows_linear(x, head).float()
        if self.output_vocab is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.output_vocab, logits)

    def restrict_output_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Score only these tokens; every other one gets logit -inf, so is
        never proposed and has probability 0. For a draft, whose vocabulary
        projection is a large share of its cost: a draft distilled from a
        target's answers need not score tokens those answers never use.
        None scores the whole vocabulary again."""
        if token_ids is not None:
            token_ids = torch.as_tensor(token_ids, dtype=torch.int64).unique()
            if token_ids.numel() == 0 or not 0 <= int(token_ids[0]) <= int(token_ids[-1]) < (
                self.config.vocab_size
            ):
                raise ValueError(f"output vocabulary must be token ids in 0..."
                                 f"{self.config.vocab_size - 1}, at least one")
            token_ids = token_ids.to(self.embed_tokens.weight.device)
        self.output_vocab, self._head_rows, self._head_t = token_ids, None, None

    def _head(self) -> torch.Tensor:
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.output_vocab is None:
            return head
        if self._head_rows is None or self._head_rows.dtype != head.dtype:
            self._head_rows = head.detach()[self.output_vocab].contiguous()
        return self._head_rows

    def _transposed_head(self, head: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection as [hidden, vocab], made once (one more
        copy of it in memory, for a 2-3x faster single-row product on CPU)."""
        if self._head_t is None or self._head_t.dtype != head.dtype:
            self._head_t = head.detach().T.contiguous()
        return self._head_t
