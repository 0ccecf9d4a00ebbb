"""A decode or verify forward of a DecoderModel from its spans to its
logits on the native kernels: its layers through layers/native_stack.py's
one native call, the embedding, rotary rows and vocabulary projection
around it as ops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from specpage.attention.backend import AttentionBackend, group_tables, lay_out_spans
from specpage.attention.cpu import NATIVE_SPAN, CpuAttention
from specpage.core.span import Span
from specpage.kernels.cpu.native import loaded_kernels
from specpage.layers import native_stack
from specpage.layers.native_stack import StackPlan, call_stack, widths_fit


class NativeStep:
    """A decode or verify forward on the native kernels from its spans to
    its logits, with as little Python between the kernels as it can take:
    the embedding, rotary rows, decoder_stack and the final norm called as
    ops, and the vocabulary projection on Q8Head's kernel where the model
    has one (else DecoderModel.logits). Each Python call on a step's path
    costs far more on caches that other work has just filled than its few
    microseconds in a loop (docs/BENCHMARKS.md, "Native layer stack"). The
    logits and the KV written are the module path's
    (tests/layers/test_native_stack.py).

    Made by ModelRunner where `unusable` finds nothing against it; a
    forward it does not take (a span longer than the attention kernel's,
    rows without a stack plan) returns None, having done nothing. A draft's
    reduced vocabulary is projected by DecoderModel.logits, as on the
    module path."""

    def __init__(self, model: Any, caches: list[torch.Tensor], block_size: int,
                 layer_groups: list[int]) -> None:
        kernels = loaded_kernels()
        assert kernels is not None, "NativeStep needs the native kernels"
        self.model = model
        self.caches = caches
        self.block_size = block_size
        # per layer the index of the layer group whose tables it reads
        # (core/layer_groups.py); none where one table serves every layer
        self.layer_groups = layer_groups if max(layer_groups, default=0) > 0 else []
        self.group_count = max(layer_groups, default=0) + 1
        self.final_eps = model.norm.eps
        self.add_rms_norm = kernels.add_rms_norm.default
        self.int8x_gemv_widened = kernels.int8x_gemv_widened.default
        self._plans: dict[int, StackPlan | None] | None = None  # the model's, when bound
        self._bound: tuple[torch.Tensor, torch.Tensor]
        # the embedding where it is not a plain lookup (Gemma's scaled one)
        self.embed = None if type(model.embed_tokens) is nn.Embedding else model.embed_tokens

    @staticmethod
    def unusable(model: Any, backend: AttentionBackend) -> str | None:
        """Why no NativeStep can run this model's forwards on this backend,
        or None where one can: what does not change from one forward to the
        next (the backend, the machine's kernels, the model's dtype and
        widths), for ModelRunner to decide once."""
        if not isinstance(backend, CpuAttention):
            return f"attention on {type(backend).__name__}, not the CPU kernel"
        kernels = loaded_kernels()
        if kernels is None or not kernels.has_bf16_gemv():
            return "no AVX-512 BF16 kernel on this machine"
        if model.embed_tokens.weight.dtype != torch.bfloat16:
            return f"{model.embed_tokens.weight.dtype} weights, not bfloat16"
        if not widths_fit(model.config):
            return "widths the fused kernels do not take"
        if not all(layer.stack_shaped for layer in model.layers):
            return f"{model.config.architecture}: layers not of the shape decoder_stack runs"
        return None

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's embedding and final norm's kernel weight, looked up once for as
        long as its tensors stay (DecoderModel._apply starts a new dict of
        stack plans when they change): each is an nn.Module attribute
        lookup, slow on a cold cache."""
        model = self.model
        plans = model.stack_plans
        if self._plans is not plans:
            self._plans = plans
            self._bound = (model.embed_tokens.weight, model.norm.kernel_weight())
        return self._bound

    def __call__(self, spans: Sequence[Span], tap: Any) -> torch.Tensor | None:
        """Called under inference mode (ModelRunner.forward)."""
        if not native_stack.ENABLED or any(len(s.token_ids) > NATIVE_SPAN for s in spans):
            return None
        model = self.model
        weight, norm = self._tensors()
        tokens = sum(len(s.token_ids) for s in spans)
        plan = model.stack_plan(tokens)
        if plan is None:
            return None
        layout = lay_out_spans(spans, self.block_size)
        group_slots, group_blocks = group_tables(spans, self.block_size, self.group_count)
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
        local = (model.rope_rows(positions, weight.dtype, max(s.end for s in spans), local=True)
                 if any(plan.local_layers) else rope)
        embedded = torch.embedding(weight, ids) if self.embed is None else self.embed(ids)
        x, branch = call_stack(
            model.config, plan, embedded, (rope, local), self.caches,
            [layout.slot_mapping, *group_slots], [layout.block_tables, *group_blocks],
            layout.query_start, layout.context_lens, tap, self.layer_groups)
        if logits_index.shape[0] != tokens:  # else every row, in order
            x, branch = x[logits_index], branch[logits_index]
        head = model.quantized_head
        if (head is None or not head.int8x or model.output_vocab is not None
                or not head.takes(x)):  # (x: the normed rows' shape)
            return model.logits(x, branch)  # type: ignore[no-any-return]
        _, normed = self.add_rms_norm(branch, x, norm, self.final_eps)
        # (the values int8x_gemv(...).float() holds, written as fp32 at once)
        return self.int8x_gemv_widened(normed, head.tiles)
