"""Decoder-only transformer of the Llama family (Llama 2/3, SmolLM, TinyLlama,
Mistral) and Qwen2 (bias on q/k/v), written against the paged-attention
interface. Q/K/V and gate/up projections are fused into one matmul each."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specpage.attention.backend import AttentionBackend, AttentionMetadata
from specpage.core.arith import cdiv
from specpage.kernels.cpu import features as cpu
from specpage.kernels.cpu.native import loaded_kernels
from specpage.models import fused, native_stack
from specpage.models.config import ModelConfig
from specpage.models.rope import cos_sin, inverse_frequencies


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def after_add(self, x: torch.Tensor,
                  residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, that sum normed)."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


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
        return cdiv(rows, 8) * 8
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


# With AVX-512, oneDNN with the weight reordered once into its blocked layout
# (torch.ops.mkldnn._linear_pointwise) beats both MKL ways from 3 rows in fp32
# and at every row count in bf16. bench/cpu_linear.py on 2 AVX-512 BF16 cores,
# ms for SmolLM2-135M's 30 layers (least of passes, median of rounds; the
# machine was shared, so these are indications, repeated where they disagreed):
#   fp32  rows  1: W@x.T padded 15-40, oneDNN 23-105    2: 15 / 23
#         rows  3: 21 / 19    4: 70 / 33    16: 89 / 56    32: 134-171 / 80-95
#   bf16  rows  1: F.linear 17.7, W@x.T 18.0, oneDNN 13.3    4: 18.9 / 22.9 / 12.2
#         rows 32: 35.0 / 30.7 / 24.5
# and for the vocabulary projection (49,152 x 576), fp32: 1 row x @ W.T 5.4,
# oneDNN 4.9-14; 2 rows W@x.T 3.1, oneDNN 5.6; 3 rows 11.5 / 8.1; 32: 62 / 31;
# bf16: oneDNN fastest at every count (1 row 2.5 against 3.9 for F.linear).
# Products of fewer rows (and every product without AVX-512, where the AVX2
# measurements above hold) take few_rows_linear. Prefill's many rows gain too.
ONEDNN_FROM_ROWS = {torch.float32: 3, torch.bfloat16: 1}


def uses_onednn(weight: torch.Tensor, rows: int) -> bool:
    """Whether a CPU product of `rows` rows by this weight runs on oneDNN."""
    first = ONEDNN_FROM_ROWS.get(weight.dtype)
    return first is not None and rows >= first and _onednn_usable(weight.dtype)


@functools.cache
def _onednn_usable(dtype: torch.dtype) -> bool:
    if not (cpu.has_avx512() and torch.backends.mkldnn.is_available()):  # type: ignore[no-untyped-call]
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedWeight:
    """A weight reordered once into a product's own layout (oneDNN's blocked
    one, the native panel kernel's), each remade when the weight it came from
    changes (another dtype, device or storage). One more copy of the weight in
    memory per layout used: the plain one stays for anything that reads
    `.weight`."""

    def __init__(self) -> None:
        # layout -> (the weight's storage and dtype it was made from, the copy)
        self._made: dict[str, tuple[tuple[int, torch.dtype], torch.Tensor]] = {}

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """oneDNN's layout, for torch.ops.mkldnn._linear_pointwise."""
        return self._remade("onednn", weight, lambda w: torch.ops.mkldnn._reorder_linear_weight(
            w, FEW_ROWS))

    def panels(self, weight: torch.Tensor) -> torch.Tensor:
        """The native panel layout (kernels/cpu/bf16_panels.cpp)."""
        return self._remade("panels", weight,
                            lambda w: bf16_kernels().bf16_panels(w))  # type: ignore[union-attr]

    def _remade(self, layout: str, weight: torch.Tensor,
                make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        source = (weight.data_ptr(), weight.dtype)
        made = self._made.get(layout)
        if made is None or made[0] != source:
            with torch.no_grad():
                made = (source, make(weight.detach()))
            self._made[layout] = made
        return made[1]


# Where the CPU has AVX-512 BF16, bf16 products of a few rows run on native
# kernels: up to GEMV_MAX_ROWS on kernels/cpu/bf16_gemv.cpp, which reads each
# weight row once, front to back, prefetching ahead (bound by reading the
# weight); up to PANELS_MAX_ROWS on kernels/cpu/bf16_panels.cpp, with the
# weight packed once more into panels of outputs (bound by the multiplies).
# oneDNN's prepacked product takes more rows. SmolLM2-135M's 30 layers of
# products, ms (bench/cpu_linear.py and a like comparison of the two native
# kernels, 2 AVX-512 BF16 cores): few-row / panels / oneDNN
#   rows  1: 6.3 / - / 10.9    5: 6.8 / - / 10.3    8: 8.6 / 7.1 / 12.2
#   rows 12: 11.2 / 8.7 / 13.6   16: 14.5 / 10.4 / 20.1   24: - / 14.9 / 21.4
#   rows 32: - / 18.5 / 24.9   48: - / 25.6 / 33.7   64: - / 33.0 / 40.5
# and the vocabulary projection 1 row 0.96 / - / 1.30, 16: 3.8 / 2.6 / 3.7,
# 64: - / 9.1 / 10.3.
GEMV_MAX_ROWS = 8
PANELS_MAX_ROWS = 64


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this CPU product runs on the native few-row kernel."""
    return (x.dtype == torch.bfloat16 and not torch.is_grad_enabled()
            and gemv_takes(weight, x.shape[0]))


def gemv_takes(weight: torch.Tensor, rows: int) -> bool:
    """Whether the native few-row kernel takes bf16 x of `rows` rows by this
    weight (it has no autograd: callers check that too)."""
    return (rows <= GEMV_MAX_ROWS and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.shape[0] % 16 == 0
            and weight.shape[1] % 32 == 0 and weight.is_contiguous()
            and bf16_kernels() is not None)


def panels_take(weight: torch.Tensor, rows: int) -> bool:
    """Whether the native panel kernel takes bf16 x of `rows` rows by this
    weight (rows the few-row kernel does not take; no autograd)."""
    return (GEMV_MAX_ROWS < rows <= PANELS_MAX_ROWS and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.shape[0] % 16 == 0
            and weight.shape[1] % 2 == 0 and weight.is_contiguous()
            and bf16_kernels() is not None)


@functools.cache
def bf16_kernels() -> object | None:
    """The native kernels where this build has AVX-512 BF16 (bf16_gemv,
    bf16_panels, and int4_gemv for models/quant.py); None elsewhere."""
    kernels = loaded_kernels()
    return kernels if kernels is not None and kernels.has_bf16_gemv() else None


def native_product(weight: torch.Tensor, packed: PackedWeight,
                   rows: int) -> native_stack.Product | None:
    """The native kernel call, with its weight operands, for bf16 x of `rows`
    rows by this weight (no bias); None where no native kernel takes it."""
    if gemv_takes(weight, rows):
        return bf16_kernels().bf16_gemv.default, (weight,)  # type: ignore[union-attr]
    if panels_take(weight, rows):
        return (bf16_kernels().bf16_panels_product.default,  # type: ignore[union-attr]
                (packed.panels(weight), weight.shape[0]))
    return None


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: PackedWeight) -> torch.Tensor:
    """x [rows, in] @ weight.T [+ bias] the fastest way this CPU has for the rows."""
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
        call = native_product(weight, packed, x.shape[0])
        if call is not None:
            kernel, operands = call
            y = kernel(x.contiguous(), *operands)
            return y if bias is None else y + bias
    if x.device.type == "cpu" and uses_onednn(weight, x.shape[0]):
        y = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), packed.of(weight), bias, "none", [], "")
        return y
    return few_rows_linear(x, weight, bias)


def direct_bf16_product(weight: torch.Tensor, packed: PackedWeight,
                        rows: int) -> native_stack.Product | None:
    """The one kernel call cpu_linear makes for bf16 x of `rows` rows by this
    weight (no bias), with its weight operands; None where it makes another."""
    call = native_product(weight, packed, rows)
    if call is None and weight.dtype == torch.bfloat16 and uses_onednn(weight, rows):
        call = (torch.ops.mkldnn._linear_pointwise.default,
                (packed.of(weight), None, "none", [], ""))
    return call


class Linear(nn.Linear):
    """nn.Linear (same parameters) with the CPU's fastest product for the rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear(x, self.weight, self.bias, self.packed)

    def direct_product(self, rows: int) -> native_stack.Product | None:
        """The kernel call for x of `rows` bf16 rows (models/native_stack.py)."""
        return None if self.bias is not None else direct_bf16_product(self.weight, self.packed,
                                                                      rows)


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
        q, k, v = fused.rope_qk(self.qkv_proj(normed), *rope, self.num_heads, self.num_kv_heads)
        backend.write_kv(cache, k, v, meta)
        attn = backend.attend(q, cache, meta, self.head_dim**-0.5)
        x, normed = self.post_attention_layernorm.after_add(self.o_proj(attn), x)
        return x, self.down_proj(fused.silu_and_mul(self.gate_up_proj(normed)))


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
        self._head_packed = PackedWeight()
        # The vocabulary projection of a few rows on the head's own Q8_0
        # blocks (models/quant.py Q8Head), set by a q4 load from a GGUF.
        self.q8_head: nn.Module | None = None
        # native_stack.stack_plan by row count, made on first use; cleared
        # when the model's tensors are replaced (.to() and the like).
        self._stack_plans: dict[int, native_stack.StackPlan | None] = {}
        # (the inv_freq it was made from, cos, sin): DecoderModel.rope_rows
        self._rope_table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
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
        logits_index: torch.Tensor,  # [num_logits] int64, rows to score, ascending, once each
        tap: LayerTap | None = None,
    ) -> torch.Tensor:
        """Logits [num_logits, vocab] in fp32 for the tokens in logits_index."""
        x = self.embed_tokens(input_ids)
        rope = self.rope_rows(positions, x.dtype)
        # The stream after the last layer's attention, and that layer's MLP
        # branch, not yet added (None without layers).
        ran = native_stack.run_layers(self, x, rope, caches, meta, backend, tap)
        x, branch = ran if ran is not None else self._run_layers(x, rope, caches, meta, backend,
                                                                 tap)
        if logits_index.shape[0] != x.shape[0]:  # else every row, in order
            x = x[logits_index]
            branch = None if branch is None else branch[logits_index]
        return self.logits(x, branch)

    def logits(self, x: torch.Tensor, branch: torch.Tensor | None) -> torch.Tensor:
        """Logits [rows, vocab] in fp32 from the stream after the last
        layer's attention and that layer's MLP branch (None: x is the
        stream after the last layer).

        No rows (a forward whose spans want no logits: prefill chunks, or a
        span that stops short of its newest token) project nothing: the
        products' kernels take at least one row (bf16_gemv 1 to 16). Its
        columns are the projection's (a tensor-parallel rank's share)."""
        head = self._head()
        if x.shape[0] == 0:
            return torch.empty((0, self.config.vocab_size if self.output_vocab is not None
                                else head.shape[0]), dtype=torch.float32, device=x.device)
        if branch is None:
            x = self.norm(x)
        else:
            _, x = self.norm.after_add(branch, x)
        if self.q8_head is not None and self.output_vocab is None and self.q8_head.takes(x):
            logits = self.q8_head(x).float()
        elif x.shape[0] == 1 and head.device.type == "cpu" and head.dtype == torch.float32:
            logits = (x @ self._transposed_head(head)).float()
        else:
            logits = cpu_linear(x, head, None, self._head_packed).float()
        if self.output_vocab is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.output_vocab, logits)

    def rope_rows(self, positions: torch.Tensor, dtype: torch.dtype, need: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, rows of a table made for the first
        positions once (grown by doubling) instead of ~7 small ops per
        forward. Each row is what cos_sin computes for its position alone.
        need: the largest position + 1, where the caller knows it."""
        if need is None:
            need = int(positions.max()) + 1
        table = self._rope_table
        if (table is None or table[0] is not self.inv_freq or table[1].dtype != dtype
                or table[1].shape[0] < need):
            size = max(need, min(max(1024, 1 << (need - 1).bit_length()),
                                 self.config.max_position))
            cos, sin = cos_sin(self.inv_freq,
                               torch.arange(size, device=self.inv_freq.device), dtype)
            table = self._rope_table = (self.inv_freq, cos, sin)
        return table[1].index_select(0, positions), table[2].index_select(0, positions)

    @property
    def stack_plans(self) -> dict[int, native_stack.StackPlan | None]:
        """The native stack plans made so far, by row count. A new dict
        whenever the model's tensors are replaced (.to() and the like), so
        its identity tells a caller that caches the tensors when to look
        them up again."""
        return self._stack_plans

    @property
    def quantized_head(self) -> nn.Module | None:
        """The Q8_0 vocabulary projection (models/quant.py Q8Head), or None.
        Read from _modules directly: a property is found on the class, not
        through nn.Module.__getattr__, which is slow on a cold cache."""
        return self._modules.get("q8_head")

    def stack_plan(self, rows: int) -> native_stack.StackPlan | None:
        """The layers' native call for `rows` rows (models/native_stack.py)."""
        if rows not in self._stack_plans:
            self._stack_plans[rows] = native_stack.stack_plan(self.layers, rows)
        return self._stack_plans[rows]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> DecoderModel:
        self._stack_plans = {}
        return super()._apply(fn, recurse)

    def _run_layers(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], caches: list[torch.Tensor],
        meta: AttentionMetadata, backend: AttentionBackend, tap: LayerTap | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        branch: torch.Tensor | None = None
        for index, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            norm = layer.input_layernorm
            x, normed = (x, norm(x)) if branch is None else norm.after_add(branch, x)
            if tap is not None:
                tap.see(index, x)
            x, branch = layer(x, normed, rope, cache, meta, backend)
        return x, branch

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
