"""Weight-only int4 linears on CPU: group-wise 4-bit weights with a scale and
zero per group of 32, 64 or 128 inputs. Where the build has AVX-512 BF16 and
the groups are of 32, specpage's own kernel (kernels/cpu/int4_gemv.cpp)
multiplies them, with the blocks' scale and offset in fp32 as the file holds
them; elsewhere torch's ``_weight_int4pack_mm_for_cpu`` (the kernel gpt-fast
and torchao use), as described below. SmolLM2's 30 layers of products, 2
AVX-512 BF16 cores: 1 row 3.45 ms native against 4.32 torch, 5 rows 8.5
against 11.5.

The kernel's convention, checked against a dense reference:
    w = (q − 8) · scale + zero,   q in 0..15,
so GGUF blocks map onto it exactly as scale = d, zero = m + 8d (Q4_1) or
zero = 0 (Q4_0): the file's own 4-bit values, not re-quantized.

The kernel is fast only with bf16 activations (measured on this AVX-512 host:
a 3072×576 product on one row took ~20 ms with fp32 or fp16 inputs against
~1.5 ms with bf16), so an fp32 model's input is cast to bf16 for the product
and the result cast back: the rest of the model, KV included, stays in the
activation dtype. Its scale and zero are bf16 (it requires the activation
dtype), which rounds GGML's float16 d and m to 8 significant bits; the
native kernel keeps them exact.

The kernel reads 4 bits a weight, so it wins while a product is bound by
reading the weights (a few rows); with more rows its unpacking costs more
than the bytes it saves. Where oneDNN runs bf16 natively (AVX-512 BF16 or
AMX), each layer also keeps its weights dense in bf16, dequantized from the
very values the kernel reads, and products of DENSE_FROM_ROWS rows or more
take them: a one-stream step reads the int4 weights, a 32-stream step the
dense ones. That costs 2 bytes a weight of memory more (212 MB for
SmolLM2-135M's projections).
"""

from __future__ import annotations

import torch
from torch import nn

from specpage.models.decoder import (
    PackedWeight,
    bf16_kernels,
    cpu_linear,
    direct_bf16_product,
    uses_onednn,
)
from specpage.models.gguf_blocks import Int4Blocks
from specpage.models.native_stack import Product
from specpage.models.quant_names import QuantizationError

GROUP_SIZES = (32, 64, 128)
KERNEL_DTYPE = torch.bfloat16  # the only activation dtype the CPU kernel is fast at
# _convert_weight_to_int4pack_for_cpu's tiling argument; its CPU layout ignores
# it beyond validation, and gpt-fast/torchao pass 1 on CPU.
INNER_K_TILES = 1
Q_OFFSET = 8  # the kernel reads q − 8
# The row count from which the dense bf16 copy is faster. SmolLM2-135M's 30
# layers of products (as bench/quantization.py's linears_alone times them),
# 2 AVX-512 BF16 cores, ms, native int4 / dense bf16 (native kernels up to 64
# rows, oneDNN above): 1 row 3.7 / 8.6, 2: 4.9 / 8.0, 3: 6.2 / 8.1,
# 4: 7.5 / 8.1, 5: 8.7 / 8.1, 6: 10.1 / 8.3; linears_alone's last full run,
# 32 rows: 49.9 / 26.1.
DENSE_FROM_ROWS = 5


def keeps_dense_copy() -> bool:
    """Whether Int4Linear keeps a dense bf16 copy for many rows (see above)."""
    return uses_onednn(torch.empty(0, dtype=KERNEL_DTYPE), DENSE_FROM_ROWS)


def check_shape(name: str, in_features: int, group: int) -> None:
    if group not in GROUP_SIZES:
        raise QuantizationError(f"{name}: q4 group size {group} unsupported; "
                                f"use one of {', '.join(map(str, GROUP_SIZES))}")
    if in_features % group:
        raise QuantizationError(f"{name}: q4 needs in_features a multiple of the group size "
                                f"{group}; this weight has {in_features} inputs")


NATIVE_ROWS = 8  # rows one call of the native kernel takes


def native_int4(blocks: Int4Blocks) -> bool:
    """Whether these weights run on the native kernel (kernels/cpu/int4_gemv.cpp):
    a build with AVX-512 BF16, groups of 32, whole pairs of groups per row and
    whole blocks of 16 outputs."""
    out_features, in_features = blocks.q.shape
    return (blocks.group == 32 and in_features % 64 == 0 and out_features % 16 == 0
            and bf16_kernels() is not None)


class Int4Linear(nn.Module):
    """A linear layer with packed int4 weights (no ``.weight``); the same
    call shape as decoder.Linear: x [rows, in_features] -> [rows, out_features].

    On a CPU with AVX-512 BF16 the native kernel runs it, with the blocks'
    own scale and offset in fp32; elsewhere torch's int4 kernel, with them
    rounded to bf16 as it requires."""

    def __init__(self, blocks: Int4Blocks, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.q.shape
        self.group_size = blocks.group
        self.native = native_int4(blocks)
        if self.native:
            # Plain attributes, not buffers: the scales must stay fp32 whatever
            # dtype the model is cast to, and the kernel runs on CPU only.
            # Two groups per 32 bytes: the first's q in the low nibbles, the second's high.
            q = blocks.q.to(torch.uint8).view(self.out_features, -1, 2, 32)
            self.nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(self.out_features, -1)
            self.scale = blocks.scale.float().contiguous()
            # sum_i W x = scale * dot(128 + q, x) + (offset - 128 scale) * sum(x), per group
            self.group_bias = (blocks.offset.float() - 128 * self.scale).contiguous()
        else:
            # Buffers, so they follow the model to a device; loading casts the model's
            # dtype before the swap, so nothing casts these bf16 ones after it.
            zero = blocks.offset + Q_OFFSET * blocks.scale
            # [in/group, out, 2]: the layout torch's kernel reads
            scales_and_zeros = torch.stack([blocks.scale, zero], dim=-1).transpose(0, 1)
            self.register_buffer("scales_and_zeros",
                                 scales_and_zeros.contiguous().to(KERNEL_DTYPE))
            # [out, in/2] uint8 in torch's kernel's own tiled layout
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                blocks.q.to(torch.int32), INNER_K_TILES)
            self.register_buffer("packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)
        # Not a buffer: never saved, and CPU-only, as the kernels are.
        self.dense = dequantize(blocks, exact=self.native) if keeps_dense_copy() else None
        self._dense_packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= DENSE_FROM_ROWS:
            y = self.dense_product(x)
        else:
            y = self.int4_product(x)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def direct_product(self, rows: int) -> Product | None:
        """The kernel call for x of `rows` bf16 rows, as forward chooses it
        (models/native_stack.py)."""
        if self.bias is not None:
            return None
        if self.dense is not None and rows >= DENSE_FROM_ROWS:
            return direct_bf16_product(self.dense, self._dense_packed, rows)
        if not self.native or rows > NATIVE_ROWS:
            return None
        return (bf16_kernels().int4_gemv.default,  # type: ignore[union-attr]
                (self.nibbles, self.scale, self.group_bias))

    def int4_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T by the int4 kernel, in KERNEL_DTYPE, no bias."""
        x = x.to(KERNEL_DTYPE).contiguous()
        if self.native:
            kernels = bf16_kernels()
            parts = [kernels.int4_gemv(part, self.nibbles, self.scale, self.group_bias)  # type: ignore[union-attr]
                     for part in x.split(NATIVE_ROWS)]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scales_and_zeros)
        return y

    def dense_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T on the dense copy, in KERNEL_DTYPE, no bias."""
        assert self.dense is not None, "no dense copy on this CPU (keeps_dense_copy)"
        return cpu_linear(x.to(KERNEL_DTYPE), self.dense, None, self._dense_packed)

    @property
    def nbytes(self) -> int:
        """Bytes one product of a few rows reads: packed weights, scales and offsets."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        if self.native:
            tensors = (self.nibbles, self.scale, self.group_bias)
        else:
            tensors = (self.packed, self.scales_and_zeros)
        return int(sum(t.numel() * t.element_size() for t in tensors) + bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, "
                f"kernel={'native' if self.native else 'torch'}")


def dequantize(blocks: Int4Blocks, exact: bool = False) -> torch.Tensor:
    """The weights the int4 kernel computes with, [out, in] in KERNEL_DTYPE:
    (q − 8)·scale + zero, with scale and zero exact (the native kernel) or
    rounded to KERNEL_DTYPE as torch's kernel holds them, then the weight
    rounded too."""
    rows, cols = blocks.q.shape
    scale, zero = blocks.scale.float(), (blocks.offset + Q_OFFSET * blocks.scale).float()
    if not exact:
        scale, zero = scale.to(KERNEL_DTYPE).float(), zero.to(KERNEL_DTYPE).float()
    q = blocks.q.float().view(rows, cols // blocks.group, blocks.group)
    w = (q - Q_OFFSET) * scale[..., None] + zero[..., None]
    return w.view(rows, cols).to(KERNEL_DTYPE).contiguous()


def quantize_rtn(weight: torch.Tensor, group: int = 32, name: str = "weight") -> Int4Blocks:
    """Round-to-nearest asymmetric group-wise int4, as gpt-fast does: per
    group, the 16 levels span [min, max]. The scale and zero are rounded to
    the kernel's bf16 first and q chosen against the rounded values, so the
    kernel computes exactly what was chosen."""
    rows, cols = weight.shape
    check_shape(name, cols, group)
    w = weight.detach().float().view(rows, cols // group, group)
    low, high = w.amin(-1), w.amax(-1)
    levels = 2**4 - 1
    scale = ((high - low) / levels).clamp(min=1e-8).to(KERNEL_DTYPE).float()
    zero = (low + Q_OFFSET * scale).to(KERNEL_DTYPE).float()
    offset = zero - Q_OFFSET * scale  # the value q = 0 stands for
    q = ((w - offset[..., None]) / scale[..., None]).round().clamp(0, levels)
    return Int4Blocks(q.to(torch.uint8).view(rows, cols), scale, offset, group)
