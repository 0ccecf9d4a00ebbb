"""A decoder's layers in one native call, for the forwards where every op
of every layer has a kernel: decode and verify steps (every span on the CPU
attention kernel) in bf16 on a CPU with AVX-512 BF16, products on the
native kernels or oneDNN, no bias. The call
(specpage/kernels/cpu/decoder_stack.cpp) makes the same kernel calls in the
same order as DecoderLayer.forward, from C++: through the modules, each of a
step's ~270 calls on SmolLM2-135M's 30 layers costs its module's dispatch,
checks and a Python call (13.1 against 10.7 ms of a batch-1 step for a loop of
direct Python calls; the native loop saves those calls too). The logits and
the KV written are identical either way (tests/models/test_native_stack.py).

A linear layer takes part through `direct_product(rows)`: the kernel and its
weight operands where one call computes x @ W.T for x of that many bf16
rows and nothing is left to do (no bias, no cast), else None.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specpage.attention.backend import AttentionBackend, AttentionMetadata, lay_out_spans
from specpage.attention.cpu import NATIVE_SPAN, CpuAttention
from specpage.kernels.cpu.native import loaded_kernels
from specpage.models.fused import LANES

Product = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]
ENABLED = True  # tests switch it off to compare with the module path


# The product kinds decoder_stack.cpp reads, by the kernel a product calls.
GEMV, PANELS, INT4, ONEDNN, INT8X = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class StackPlan:
    """decoder_stack's per-layer operands for one row count."""

    norms: list[torch.Tensor]  # per layer: input norm, post-attention norm
    kinds: list[int]  # per layer: qkv, o, gate_up, down
    outs: list[int]  # output features per product (the panel kernel reads them)
    operands: list[torch.Tensor]  # each product's, in order


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
    has no kernel."""
    if not widths_fit(model.config):
        return None
    spans = _short_spans(x, meta, backend)
    if spans is None or rope[0].dtype != x.dtype:
        return None
    plan = model.stack_plan(x.shape[0])
    if plan is None:
        return None
    return _call_stack(model.config, plan, x, rope, list(caches), meta.slot_mapping, *spans, tap)


def widths_fit(c: Any) -> bool:
    """Whether a config's widths are ones the fused kernels take (models/fused.py)."""
    return not (c.hidden_size % LANES or (c.head_dim // 2) % LANES or c.intermediate_size % LANES)


def _call_stack(c: Any, plan: StackPlan, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                caches: list[torch.Tensor], slots: torch.Tensor, block_tables: torch.Tensor,
                query_start: torch.Tensor, context_lens: torch.Tensor, tap: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """decoder_stack on these operands; the tap sees the states it asked for."""
    taps = sorted(set(tap.layers)) if tap is not None else []
    x, branch, tapped = loaded_kernels().decoder_stack.default(
        x, rope[0], rope[1], caches, slots, block_tables, query_start, context_lens,
        plan.norms, plan.kinds, plan.outs, plan.operands, c.num_heads, c.num_kv_heads,
        c.rms_norm_eps, c.head_dim**-0.5, taps)
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
    an op without a kernel (or there are no layers)."""
    kernels = loaded_kernels()
    if kernels is None or not kernels.has_bf16_gemv() or not layers:
        return None
    kinds_by_kernel = {kernels.bf16_gemv.default: GEMV, kernels.bf16_panels_product.default: PANELS,
                       kernels.int4_gemv.default: INT4, kernels.int8x_gemv.default: INT8X,
                       torch.ops.mkldnn._linear_pointwise.default: ONEDNN}
    plan = StackPlan([], [], [], [])
    for layer in layers:
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(n.dtype != torch.bfloat16 for n in norms):
            return None
        plan.norms.extend(norms)
        for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            product = linear.direct_product(rows)
            kind = None if product is None else kinds_by_kernel.get(product[0])
            if product is None or kind is None:
                return None
            operands = product[1]
            plan.kinds.append(kind)
            plan.outs.append(operands[1] if kind == PANELS else 0)
            plan.operands.extend(operands[:1] if kind in (PANELS, ONEDNN) else operands)
    return plan


class NativeStep:
    """A decode or verify forward on the native kernels from its spans to
    its logits, with as little Python between the kernels as it can take:
    the embedding, rotary rows, decoder_stack and the final norm called as
    ops, and the vocabulary projection on Q8Head's kernel where the model
    has one (else DecoderModel.logits). Each Python call on a step's path
    costs far more on caches that other work has just filled than its few
    microseconds in a loop: on SmolLM2-135M q4 (2 threads, other models'
    steps between, as bench/quantization.py runs them, 24 rounds in one
    process), a batch-1 decode step 0.97x the module path's (0.87-0.99,
    10th-90th percentile; ~0.16 ms), 5 sequences 0.97x; bf16 weights and 32
    sequences level. The logits and the KV written are the module path's
    (tests/models/test_native_stack.py).

    Made by ModelRunner for a DecoderModel on the CPU attention kernel; a
    forward it does not take (a span longer than the attention kernel's,
    rows without a stack plan, grad mode) returns None, having done
    nothing. A draft's reduced vocabulary is projected by
    DecoderModel.logits, as on the module path."""

    def __init__(self, model: Any, caches: list[torch.Tensor], block_size: int) -> None:
        kernels = loaded_kernels()
        assert kernels is not None, "NativeStep needs the native kernels"
        self.model = model
        self.caches = caches
        self.block_size = block_size
        self.final_eps = model.norm.eps
        self.add_rms_norm = kernels.add_rms_norm.default
        self.int8x_gemv = kernels.int8x_gemv.default
        self.fits = widths_fit(model.config)
        self._plans: dict[int, StackPlan | None] | None = None  # the model's, when bound
        self._bound: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def of(cls, model: Any, backend: AttentionBackend, caches: list[torch.Tensor],
           block_size: int) -> NativeStep | None:
        """One for this model and backend, or None where none can run."""
        if not isinstance(backend, CpuAttention) or loaded_kernels() is None:
            return None
        return cls(model, caches, block_size)

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's embedding and final norm weight, looked up once for as
        long as its tensors stay (DecoderModel._apply starts a new dict of
        stack plans when they change): each is an nn.Module attribute
        lookup, slow on a cold cache."""
        model = self.model
        plans = model.stack_plans
        if self._plans is not plans:
            self._plans = plans
            self._bound = (model.embed_tokens.weight, model.norm.weight)
        return self._bound

    def __call__(self, spans: Sequence[Any], tap: Any) -> torch.Tensor | None:
        model = self.model
        weight, norm = self._tensors()
        if (not ENABLED or weight.dtype != torch.bfloat16 or not self.fits
                or torch.is_grad_enabled()
                or any(len(s.token_ids) > NATIVE_SPAN for s in spans)):
            return None
        tokens = sum(len(s.token_ids) for s in spans)
        plan = model.stack_plan(tokens)
        if plan is None:
            return None
        layout = lay_out_spans([(s.start, len(s.token_ids), list(s.block_table)) for s in spans],
                               self.block_size)
        # the token ids, their positions and the rows to score, as slices of one tensor
        values = [t for s in spans for t in s.token_ids]
        values.extend(p for s in spans for p in range(s.start, s.end))
        rows = 0
        for s in spans:
            rows += len(s.token_ids)
            values.extend(range(rows - s.num_logits, rows))
        ids, positions, logits_index = torch.tensor(values, dtype=torch.int64).split(
            [tokens, tokens, len(values) - 2 * tokens])
        rope = model.rope_rows(positions, weight.dtype, max(s.end for s in spans))
        x, branch = _call_stack(model.config, plan, torch.embedding(weight, ids), rope,
                                self.caches, layout.slot_mapping, layout.block_tables,
                                layout.query_start, layout.context_lens, tap)
        if logits_index.shape[0] != tokens:  # else every row, in order
            x, branch = x[logits_index], branch[logits_index]
        head = model.quantized_head
        if (head is None or not head.int8x or model.output_vocab is not None
                or not head.takes(x)):  # (x: the normed rows' shape)
            return model.logits(x, branch)  # type: ignore[no-any-return]
        _, normed = self.add_rms_norm(branch, x, norm, self.final_eps)
        return self.int8x_gemv(normed, head.tiles).float()
