"""One decoder layer of the Llama shape (Llama, Mistral, SmolLM, Qwen2 with
bias on q/k/v, Qwen3 with q/k norms), written against the paged-attention
interface. Q/K/V and gate/up projections are fused into one matmul each."""

from __future__ import annotations

import torch
from torch import nn

from specpage.attention.backend import AttentionBackend, AttentionMetadata
from specpage.layers import fused, native_stack
from specpage.layers.linear import Linear
from specpage.layers.norm import RMSNorm
from specpage.models.config import ModelConfig


class DecoderLayer(nn.Module):
    norm_class: type[nn.Module] = RMSNorm  # the family's RMSNorm, for every norm of the layer

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, d
        )
        self.scale = config.attention_scale
        self.window = config.window_of(index)  # keys seen back from a query, None: all
        # Whether the model's rotary rows for sliding layers are this layer's.
        self.local_rope = config.rope_of(index) is not config.rope
        norm = self.norm_class
        self.input_layernorm = norm(h, config.rms_norm_eps)
        self.qkv_proj = Linear(h, (config.num_heads + 2 * config.num_kv_heads) * d,
                                  bias=config.qkv_bias)
        # Over each head's d features of q and k, before rotary (Qwen3, Gemma 3).
        self.q_norm = norm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(d, config.rms_norm_eps) if config.qk_norm else None
        self.o_proj = Linear(config.num_heads * d, h, bias=config.o_bias)
        self.post_attention_layernorm = norm(h, config.rms_norm_eps)
        self.gate_up_proj = Linear(h, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, h, bias=config.mlp_bias)

    # Whether decoder_stack.cpp computes this layer (layers/native_stack.py),
    # and how: its MLP's activation; a family whose forward differs otherwise
    # than by its norms and activation sets stack_shaped False.
    stack_shaped = True
    stack_activation = native_stack.SILU

    def stack_norm_modules(self) -> tuple[nn.Module, ...]:
        """The norms decoder_stack.cpp applies, in its order: before
        attention, then after it (before the MLP)."""
        return (self.input_layernorm, self.post_attention_layernorm)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden], the residual stream entering the layer
        normed: torch.Tensor,  # x through input_layernorm (fused with the add that made x)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [num_tokens, head_dim]
        cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream after attention, and the MLP's branch, which the next
        layer's norm (or the final one) adds to it: the layer's output is
        their sum."""
        attn = self.attention(normed, rope, cache, meta, backend)
        x, normed = self.post_attention_layernorm.after_add(attn, x)
        return x, self.down_proj(fused.silu_and_mul(self.gate_up_proj(normed)))

    def attention(
        self, normed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor,
        meta: AttentionMetadata, backend: AttentionBackend,
    ) -> torch.Tensor:
        """The attention branch, through o_proj: [num_tokens, hidden]."""
        q, k, v = self.rotated_qkv(self.qkv_proj(normed), rope)
        backend.write_kv(cache, k, v, meta)
        return self.o_proj(backend.attend(q, cache, meta, self.scale, self.window))

    def rotated_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [tokens, (heads + 2 kv_heads) * d] -> q [tokens, heads, d] and
        k [tokens, kv_heads, d], normed where the layer has q/k norms and
        rotated, and v [tokens, kv_heads, d]."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.q_norm is None or self.k_norm is None:
            return fused.rope_qk(qkv, *rope, heads, kv_heads)
        # Normed into a new qkv, then rotated by the same op as the Llama
        # shape's: decoder_stack.cpp computes these layers so, and gives the same bits.
        n, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q = self.q_norm(q.reshape(n * heads, d)).view(n, heads * d)
        k = self.k_norm(k.reshape(n * kv_heads, d)).view(n, kv_heads * d)
        return fused.rope_qk(torch.cat([q, k, v], dim=-1), *rope, heads, kv_heads)
