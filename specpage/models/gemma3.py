"""Gemma 3's text decoder, where it differs from the Llama shape
(models/layer.py): Gemma's (1 + weight) RMSNorm everywhere, norms after
the attention and MLP branches as well as before them, a GeGLU MLP (tanh
GELU), and an embedding scaled by sqrt(hidden_size). Its sliding layers,
their rotary base and the attention scale are the config's
(models/config.py), read by DecoderLayer as for every family."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specpage.attention.backend import AttentionBackend, AttentionMetadata
from specpage.layers import fused, native_stack
from specpage.layers.norm import GemmaRMSNorm
from specpage.models.config import ModelConfig
from specpage.models.layer import DecoderLayer


class ScaledEmbedding(nn.Embedding):
    """The token embedding times sqrt(hidden_size), a float32 scalar cast to
    the weight's dtype first, as transformers' Gemma3TextScaledWordEmbedding
    does (in bf16, sqrt(3072) = 55.43 becomes 55.5)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # sqrt(hidden_size) by the dtype the weight was cast to, made once
        # (a tensor made each step was ~10 us of Gemma 3 270M's embedding)
        self.scales: dict[torch.dtype, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype
        scale = self.scales.get(dtype)
        if scale is None:
            scale = self.scales[dtype] = torch.tensor(self.embedding_dim**0.5,
                                                      dtype=torch.float32).to(dtype)
        return super().forward(input_ids) * scale


class Gemma3Layer(DecoderLayer):
    norm_class = GemmaRMSNorm
    stack_activation = native_stack.GELU_TANH

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index)
        h = config.hidden_size
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden], the residual stream entering the layer
        normed: torch.Tensor,  # x through input_layernorm
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [num_tokens, head_dim]
        cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderLayer.forward's pair: the stream after attention (its
        branch normed before the add) and the MLP's branch, normed."""
        attn = self.attention(normed, rope, cache, meta, backend)
        x, normed = self.pre_feedforward_layernorm.after_add(self.post_attention_layernorm(attn), x)
        gate_up = self.gate_up_proj(normed)
        return x, self.post_feedforward_layernorm(self.down_proj(fused.gelu_tanh_and_mul(gate_up)))

    def stack_norm_modules(self) -> tuple[nn.Module, ...]:
        """decoder_stack.cpp's four: before attention, after it, before the
        MLP, after it."""
        return (self.input_layernorm, self.post_attention_layernorm,
                self.pre_feedforward_layernorm, self.post_feedforward_layernorm)

