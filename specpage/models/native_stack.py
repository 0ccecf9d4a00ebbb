"""A decoder's layers as one loop of direct kernel calls, for the forwards
where every op of every layer has one: decode and verify steps (every span
on the CPU attention kernel) in bf16 on a CPU with AVX-512 BF16, products
on the native kernel or oneDNN, no bias. DecoderLayer.forward makes the same
calls in the same order, each through its module's dispatch and checks; on
SmolLM2-135M's 30 layers those cost about 2 ms of a 13 ms batch-1 step (13.1
against 10.7 ms) and 4 ms of a 48 ms step of 32 sequences. The logits and the
KV written are identical either way (tests/test_native_stack.py).

A linear layer takes part through `direct_product(rows)`: the kernel and its
weight operands where one call computes x @ W.T for x of that many bf16
rows and nothing is left to do (no bias, no cast), else None.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from specpage.attention.backend import AttentionBackend, AttentionMetadata
from specpage.attention.cpu import CpuAttention
from specpage.kernels.native import loaded_kernels
from specpage.models.fused import LANES

Product = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]
ENABLED = True  # tests switch it off to compare with the module path


def run_layers(
    model: Any,  # a DecoderModel: .layers, .config
    x: torch.Tensor,  # [rows, hidden], the embedded tokens
    rope: tuple[torch.Tensor, torch.Tensor],
    caches: Sequence[torch.Tensor],
    meta: AttentionMetadata,
    backend: AttentionBackend,
    tap: Any,  # LayerTap | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the stream after the last layer's attention, its MLP branch), as
    DecoderModel's loop gives them; None, having done nothing, where some op
    has no direct call."""
    c = model.config
    if c.hidden_size % LANES or (c.head_dim // 2) % LANES or c.intermediate_size % LANES:
        return None  # widths the fused kernels do not take (models/fused.py)
    spans = _short_spans(x, meta, backend)
    if spans is None or rope[0].dtype != x.dtype:
        return None
    calls = model.direct_calls(x.shape[0])
    if not calls:  # None, or a model without layers
        return None
    kernels = loaded_kernels()
    rms_norm, add_rms_norm = kernels.rms_norm.default, kernels.add_rms_norm.default
    # rope_qk with its k and the v written into the cache at the forward's slots,
    # as the CPU backend's write_kv puts them
    rope_into_cache = kernels.rope_qk_into_cache.default
    silu_and_mul = kernels.silu_and_mul.default
    attention = kernels.paged_attention.default
    heads, kv_heads, head_dim, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    scale = head_dim**-0.5
    cos, sin = rope
    block_tables, query_start, context_lens = spans
    branch: torch.Tensor | None = None
    for index, ((input_norm, qkv, o, post_norm, gate_up, down), cache) in enumerate(
            zip(calls, caches, strict=True)):
        if branch is None:
            normed = rms_norm(x, input_norm, eps)
        else:
            x, normed = add_rms_norm(branch, x, input_norm, eps)
        if tap is not None:
            tap.see(index, x)
        mixed = qkv[0](normed, *qkv[1])
        q = rope_into_cache(mixed, cos, sin, heads, kv_heads, cache, meta.slot_mapping)
        attended = attention(q, cache, block_tables, query_start, context_lens, scale)
        x, normed = add_rms_norm(o[0](attended, *o[1]), x, post_norm, eps)
        branch = down[0](silu_and_mul(gate_up[0](normed, *gate_up[1])), *down[1])
    assert branch is not None
    return x, branch


def _short_spans(x: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The attention kernel's operands, where the rest of this forward fits."""
    if (not ENABLED or x.device.type != "cpu" or x.dtype != torch.bfloat16
            or torch.is_grad_enabled() or not isinstance(backend, CpuAttention)):
        return None
    short = backend.all_short(meta)
    if short is None:
        return None
    return short.block_tables, short.query_start, short.context_lens


def layer_calls(layers: Sequence[Any], rows: int) -> list[tuple[Any, ...]] | None:
    """Per layer: input norm weight, qkv product, o product, post-attention
    norm weight, gate_up product, down product."""
    kernels = loaded_kernels()
    if kernels is None or not kernels.has_bf16_gemv():
        return None
    calls = []
    for layer in layers:
        products = [linear.direct_product(rows) for linear in
                    (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(p is None for p in products) or any(n.dtype != torch.bfloat16 for n in norms):
            return None
        qkv, o, gate_up, down = products
        calls.append((norms[0], qkv, o, norms[1], gate_up, down))
    return calls
