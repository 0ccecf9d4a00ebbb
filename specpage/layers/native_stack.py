"""A decoder's layers in one native call, for the forwards where every op
of every layer has a kernel: decode and verify steps (every span on the CPU
attention kernel) in bf16 on a CPU with AVX-512 BF16, products on the
native kernels or oneDNN, no bias. The call
(specpage/kernels/cpu/decoder_stack.cpp) makes the same kernel calls in the
same order as DecoderLayer.forward, from C++: through the modules, each of a
step's ~270 calls on SmolLM2-135M's 30 layers costs its module's dispatch,
checks and a Python call, which the native loop saves (docs/BENCHMARKS.md,
"Native layer stack"). The logits and the KV written are identical either
way (tests/layers/test_native_stack.py).

A linear layer takes part through `direct_product(rows)`: the kernel and its
weight operands where one call computes x @ W.T for x of that many bf16
rows and nothing is left to do (no bias, no cast), else None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specpage.attention.backend import AttentionBackend, AttentionMetadata
from specpage.attention.cpu import CpuAttention
from specpage.kernels.cpu.native import loaded_kernels
from specpage.layers.fused import LANES

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [tokens, head_dim]

ENABLED = True  # tests switch it off to compare with the module path


# The product kinds decoder_stack.cpp reads, by the kernel a product calls;
# a K-quant product of n runs of one type each is kind KQUANT + n - 1.
GEMV, PANELS, INT4, ONEDNN, INT8X, KQUANT = 0, 1, 2, 3, 4, 5
KQUANT_RUNS = 4  # the most runs decoder_stack.cpp takes in one product
SILU, GELU_TANH = 0, 1  # the MLP's activation of its gate, times up


@dataclass(frozen=True)
class StackPlan:
    """decoder_stack's per-layer operands for one row count."""

    norms: list[torch.Tensor]  # per layer its norms' kernel weights (DecoderLayer.stack_norms)
    kinds: list[int]  # per layer: qkv, o, gate_up, down
    outs: list[int]  # output features per product (the panel kernel reads them)
    operands: list[torch.Tensor]  # each product's, in order
    qk_norms: list[torch.Tensor]  # per layer q_norm, k_norm [head_dim]; none without them
    windows: list[int]  # per layer the keys a query sees back, 0: all
    local_layers: list[int]  # per layer 1 where it takes the sliding layers' rotary
    activation: int  # SILU or GELU_TANH
    scale: float  # the attention's


def run_layers(
    model: Any,  # a DecoderModel: .layers, .config
    x: torch.Tensor,  # [rows, hidden], the embedded tokens
    ropes: tuple[Rope, Rope],  # the full-attention layers' rotary rows, the sliding layers'
    caches: Sequence[torch.Tensor],
    metas: Sequence[AttentionMetadata],  # each layer's
    backend: AttentionBackend,
    tap: Any,  # LayerTap | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the stream after the last layer's attention, its MLP branch), as
    DecoderModel's loop gives them; None, having done nothing, where some op
    has no kernel."""
    if not widths_fit(model.config) or not metas:
        return None
    distinct = list({id(m): m for m in metas}.values())  # a layer group's, in order
    tables = [_short_spans(x, meta, backend) for meta in distinct]
    if any(t is None for t in tables) or any(r[0].dtype != x.dtype for r in ropes):
        return None
    plan = model.stack_plan(x.shape[0])
    if plan is None:
        return None
    index = {id(m): i for i, m in enumerate(distinct)}
    short = [t for t in tables if t is not None]
    return call_stack(model.config, plan, x, ropes, list(caches),
                      [m.slot_mapping for m in distinct], [t[0] for t in short],
                      short[0][1], short[0][2], tap,
                      [index[id(m)] for m in metas] if len(distinct) > 1 else [])


def widths_fit(c: Any) -> bool:
    """Whether a config's widths are ones the fused kernels take (layers/fused.py)."""
    return not (c.hidden_size % LANES or (c.head_dim // 2) % LANES or c.intermediate_size % LANES)


def call_stack(c: Any, plan: StackPlan, x: torch.Tensor, ropes: tuple[Rope, Rope],
               caches: list[torch.Tensor], slots: list[torch.Tensor],
               block_tables: list[torch.Tensor], query_start: torch.Tensor,
               context_lens: torch.Tensor, tap: Any, layer_groups: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """decoder_stack on these operands; the tap sees the states it asked for.
    ropes: the full-attention layers' rotary rows and the sliding layers';
    slots, block_tables: per layer group (core/layer_groups.py), and per
    layer its group's index (none: every layer the first's)."""
    taps = sorted(set(tap.layers)) if tap is not None else []
    rope, local = ropes
    local_rope = list(local) if any(plan.local_layers) else []
    x, branch, tapped = loaded_kernels().decoder_stack.default(
        x, rope[0], rope[1], caches, slots[0], block_tables[0], query_start, context_lens,
        plan.norms, plan.kinds, plan.outs, plan.operands, c.num_heads, c.num_kv_heads,
        c.rms_norm_eps, plan.scale, taps, plan.qk_norms, plan.windows, local_rope,
        plan.local_layers if local_rope else [], plan.activation, slots[1:],
        block_tables[1:], layer_groups)
    for index, state in zip(taps, tapped, strict=True):
        tap.see(index, state)
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


def stack_plan(layers: Sequence[Any], rows: int) -> StackPlan | None:
    """decoder_stack's operands for x of `rows` rows; None where a layer has
    an op without a kernel (a layer not `stack_shaped`, norms not in bf16),
    or there are no layers."""
    kernels = loaded_kernels()
    if (kernels is None or not kernels.has_bf16_gemv() or not layers
            or not all(layer.stack_shaped for layer in layers)
            or len({(layer.stack_activation, layer.scale) for layer in layers}) != 1):
        return None
    kinds_by_kernel = {kernels.bf16_gemv.default: GEMV, kernels.bf16_panels_product.default: PANELS,
                       kernels.int4_gemv.default: INT4, kernels.int8x_gemv.default: INT8X,
                       torch.ops.mkldnn._linear_pointwise.default: ONEDNN}
    plan = StackPlan([], [], [], [], [], [], [], layers[0].stack_activation, layers[0].scale)
    for layer in layers:
        # a bf16 weight is multiplied after the rounding, a float32 one (Gemma's
        # 1 + weight) before it: the norms' own weights must be bf16
        qk_norms = () if layer.q_norm is None else (layer.q_norm, layer.k_norm)
        if any(n.weight.dtype != torch.bfloat16 for n in (*layer.stack_norm_modules(), *qk_norms)):
            return None
        plan.norms.extend(n.kernel_weight() for n in layer.stack_norm_modules())
        plan.qk_norms.extend(n.kernel_weight() for n in qk_norms)
        plan.windows.append(layer.window or 0)
        plan.local_layers.append(int(layer.local_rope))
        for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            product = linear.direct_product(rows)
            kind = None if product is None else kinds_by_kernel.get(product[0])
            if product is not None and product[0] == kernels.kquant_gemv.default:
                runs = len(product[1]) - 1  # the runs' (type, column, outputs), then their tiles
                kind = KQUANT + runs - 1 if runs <= KQUANT_RUNS else None
            if product is None or kind is None:
                return None
            operands = product[1]
            plan.kinds.append(kind)
            plan.outs.append(operands[1] if kind == PANELS
                             else linear.out_features if kind >= KQUANT else 0)
            plan.operands.extend(operands[:1] if kind in (PANELS, ONEDNN) else operands)
    if plan.qk_norms and len(plan.qk_norms) != 2 * len(layers):
        return None  # q/k norms on some layers only: no family has them so
    return plan
