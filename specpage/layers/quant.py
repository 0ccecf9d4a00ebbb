"""Weight-only int4 linears on CPU: group-wise 4-bit weights with a scale and
zero per group of 32, 64 or 128 inputs. Where the build has AVX-512 BF16 and
the groups are of 32, specpage's own kernel (kernels/cpu/int4_gemv.cpp)
multiplies them, with the blocks' scale and offset exact as the file holds
them (float16, or fp32 where a float16 cannot hold them); elsewhere torch's
``_weight_int4pack_mm_for_cpu`` (the kernel gpt-fast and torchao use), as
described below.

The kernel's convention, checked against a dense reference:
    w = (q − 8) · scale + zero,   q in 0..15,
so GGUF blocks map onto it exactly as scale = d, zero = m + 8d (Q4_1) or
zero = 0 (Q4_0): the file's own 4-bit values, not re-quantized.

The kernel is fast only with bf16 activations (docs/BENCHMARKS.md,
"Quantized linears"), so an fp32 model's input is cast to bf16 for the
product and the result cast back: the rest of the model, KV included, stays
in the activation dtype. Its scale and zero are bf16 (it requires the
activation dtype), which rounds GGML's float16 d and m to 8 significant
bits; the native kernel keeps them exact.

Where the CPU also has AVX-512 VNNI, each product takes its bf16 x to
int8 per row and group of 32 (d = max |x| / 127, as llama.cpp's Q8 blocks
do) and sums the weights' levels times those integers exactly in int32
(int8x_gemv, vpdpbusd: 64 products an instruction, twice vdpbf16ps's, and
no conversion of the levels to floats). The weights stay exact; x loses
what 8 bits per group lose (its cost in perplexity is measured by
bench/quantization.py). That kernel was measured faster than the bf16 one
at every row count and, on a CPU without AMX, faster than the dense bf16
weights too, so there its layers keep no dense copy. With AMX, oneDNN's
bf16 products of many rows run on its tiles and pass it; there its layers
keep a dense copy for INT8X_DENSE_FROM_ROWS rows or more (a prefill chunk,
or a verify step of many streams), 212 MB more for SmolLM2-135M.

The bf16 kernel reads 4 bits a weight, so it wins while a product is
bound by reading the weights (a few rows); with more rows its unpacking
costs more than the bytes it saves. Where it runs and oneDNN runs bf16
natively (AVX-512 BF16 or AMX), each layer also keeps its weights dense in
bf16, dequantized from the very values the kernel reads, and products of
DENSE_FROM_ROWS rows or more take them: a one-stream step reads the int4
weights, a 32-stream step the dense ones. That costs 2 bytes a weight of
memory more (212 MB for SmolLM2-135M's projections).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specpage.kernels.cpu import features as cpu
from specpage.layers.products import (
    PackedWeight,
    Product,
    bf16_kernels,
    cpu_linear,
    direct_bf16_product,
    row_invariant_on,
    uses_onednn,
)


@dataclass(frozen=True)
class Int4Blocks:
    """One weight of ``rows × cols`` in groups of ``group`` inputs:
    w[r, c] = scale[r, c // group] · q[r, c] + offset[r, c // group]."""

    q: torch.Tensor  # [rows, cols] uint8, values 0..15
    scale: torch.Tensor  # [rows, cols // group] float32 (exact: float16 values)
    offset: torch.Tensor  # [rows, cols // group] float32
    group: int

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight, computed as GGML computes it (d·q + m, or d·(q−8))."""
        rows, cols = self.q.shape
        q = self.q.view(rows, cols // self.group, self.group).float()
        return (self.scale[..., None] * q + self.offset[..., None]).view(rows, cols)

    @staticmethod
    def cat(parts: list[Int4Blocks]) -> Int4Blocks:
        assert len({p.group for p in parts}) == 1
        return Int4Blocks(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.offset for p in parts]), parts[0].group)

    def take_rows(self, order: torch.Tensor) -> Int4Blocks:
        return Int4Blocks(self.q[order], self.scale[order], self.offset[order], self.group)


GROUP_SIZES = (32, 64, 128)
KERNEL_DTYPE = torch.bfloat16  # the only activation dtype the CPU kernel is fast at
# _convert_weight_to_int4pack_for_cpu's tiling argument; its CPU layout ignores
# it beyond validation, and gpt-fast/torchao pass 1 on CPU.
INNER_K_TILES = 1
Q_OFFSET = 8  # the kernel reads q − 8
# The row count from which the dense bf16 copy was measured faster than the
# int4 kernel (docs/BENCHMARKS.md, "Quantized linears: the dense copy").
DENSE_FROM_ROWS = 24
# The same for the int8x kernel, on a CPU with AMX (the same section).
INT8X_DENSE_FROM_ROWS = 40


def dense_from_rows(int8x: bool) -> int:
    """The row count from which an Int4Linear's products take its dense copy
    (where it keeps one): int8x or bf16 products."""
    return INT8X_DENSE_FROM_ROWS if int8x else DENSE_FROM_ROWS


def keeps_dense_copy(int8x: bool = False) -> bool:
    """Whether an Int4Linear on the bf16 products, or on int8x products,
    keeps a dense bf16 copy for many rows (see above): the int8x ones only
    where oneDNN runs bf16 on AMX."""
    if int8x and not cpu.has_amx():
        return False
    return uses_onednn(torch.empty(0, dtype=KERNEL_DTYPE), dense_from_rows(int8x))


OUT_MULTIPLE = 16  # outputs both int4 kernels take in whole blocks of


# Whether products of int4 (and Q8Head's Q8_0) weights take x to int8 per
# group of 32 where the CPU has AVX-512 VNNI (int8x_gemv, as llama.cpp
# does), rather than multiplying bf16 x (int4_gemv). Read when a layer is
# built; bench/quantization.py sets it False to measure the bf16 products.
# A model computing in a chosen fp32 is built with int8x False: that choice
# asks for precision (models/quant_load.py).
INT8X_PRODUCTS = True


def int8x_kernels() -> bool:
    """Whether int4 layers built now take their products with x in int8."""
    kernels = bf16_kernels()
    return INT8X_PRODUCTS and kernels is not None and bool(kernels.has_int8x_gemv())  # type: ignore[attr-defined]


def native_int4(blocks: Int4Blocks) -> bool:
    """Whether these weights run on the native kernel (kernels/cpu/int4_gemv.cpp):
    a build with AVX-512 BF16, groups of 32 and whole blocks of 16 outputs."""
    out_features, in_features = blocks.q.shape
    return (blocks.group == 32 and in_features % 32 == 0 and out_features % 16 == 0
            and bf16_kernels() is not None)


class Int4Linear(nn.Module):
    """A linear layer with packed int4 weights (no ``.weight``); the same
    call shape as layers.linear.Linear: x [rows, in_features] -> [rows, out_features].

    On a CPU with AVX-512 BF16 the native kernel runs it, with the blocks'
    own scale and offset, exact; elsewhere torch's int4 kernel, with them
    rounded to bf16 as it requires."""

    def __init__(self, blocks: Int4Blocks, bias: torch.Tensor | None = None,
                 int8x: bool = True) -> None:
        """int8x False: never take x to int8 (a model computing in fp32)."""
        super().__init__()
        self.out_features, self.in_features = blocks.q.shape
        self.group_size = blocks.group
        self.native = native_int4(blocks)
        self.int8x = self.native and int8x and int8x_kernels()
        if self.native:
            # uint8, so no cast of the model's dtype touches the fp32 scales
            # inside; not persistent: the loader's cache keeps the blocks.
            self.register_buffer("tiles", int8x_stream(blocks) if self.int8x
                                 else int4_stream(blocks), persistent=False)
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
        # A buffer, so that hugepages.pack moves it with the weights; the
        # quantizers cast a model after the swap only to bf16, its own dtype.
        self.dense: torch.Tensor | None
        self.register_buffer("dense", dequantize(blocks, exact=self.native)
                             if keeps_dense_copy(self.int8x) else None,
                             persistent=False)
        self._dense_packed = PackedWeight()

    def _takes_dense(self, rows: int) -> bool:
        """Whether a product of `rows` rows takes the dense copy: never where
        products are row-invariant (layers/products.py row_invariant), since
        the int4 kernels are (they sum each row alone: int4_gemv.cpp, and
        torch's int4 kernel, measured in tests/layers/test_row_invariance.py)."""
        return (self.dense is not None and rows >= dense_from_rows(self.int8x)
                and not row_invariant_on())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = self._takes_dense(x.shape[0])
        y = (self.dense_product(x) if dense else self.int4_product(x)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def direct_product(self, rows: int) -> Product | None:
        """The kernel call for x of `rows` bf16 rows, as forward chooses it
        (layers/native_stack.py)."""
        if self.bias is not None:
            return None
        if self._takes_dense(rows):
            return direct_bf16_product(self.dense, self._dense_packed, rows)
        if not self.native:
            return None
        return self._native_op().default, (self.tiles,)

    def _native_op(self) -> Any:
        kernels: Any = bf16_kernels()
        return kernels.int8x_gemv if self.int8x else kernels.int4_gemv

    def int4_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T by the int4 kernel, in KERNEL_DTYPE, no bias."""
        x = x.to(KERNEL_DTYPE).contiguous()
        if self.native:
            y_native: torch.Tensor = self._native_op()(x, self.tiles)
            return y_native
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
            tensors: tuple[torch.Tensor, ...] = (self.tiles,)
        else:
            tensors = (self.packed, self.scales_and_zeros)
        return int(sum(t.numel() * t.element_size() for t in tensors) + bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, "
                f"kernel={('int8x' if self.int8x else 'native') if self.native else 'torch'}")


NIBBLE_BYTES = 256  # of a tile: 16 outputs x 32 inputs
FIFTH_BIT_BYTES = 64  # of a q5 tile: a bit of each of 16 outputs x 32 inputs
Q5_TILE_BYTES = NIBBLE_BYTES + FIFTH_BIT_BYTES + 32  # + 16 fp16 scales


def fp16_exact(blocks: Int4Blocks) -> bool:
    """Whether every scale and offset is a float16 value (a GGUF's always
    are: GGML stores d and m so; round-to-nearest's offsets are fp32 sums),
    so that the native kernel's tiles can hold them in 16 bits."""
    return _fp16_values(blocks.scale) and _fp16_values(blocks.offset)


def _fp16_values(values: torch.Tensor) -> bool:
    """Whether float16 holds every one of these values exactly."""
    return bool((values.float().half().float() == values.float()).all())


def int4_stream(blocks: Int4Blocks, half: bool | None = None) -> torch.Tensor:
    """The native kernel's operand (kernels/cpu/int4_gemv.cpp), uint8
    [out / 16, in / 32, 320 or 384]: per 16 outputs and group of 32 inputs,
    the nibbles as 4 chunks of 32 16-bit words (word 2l + t of chunk j holds
    q[l][2(4j + k) + t] in its nibble k), then, where float16 holds them
    exactly (fp16_exact), the 16 scales and the 16 offsets in float16 (the
    kernel takes the bias, offset - 128 scale, in fp32); else the 16 scales
    and the 16 biases in fp32. Exact either way. (half: force the one or the
    other; float16 only where it is exact.)"""
    half = _half_tiles(blocks, half)
    out_features, in_features = blocks.q.shape
    tiles, groups = out_features // 16, in_features // 32
    # q as [tile, l, group, j, k, t]: input 32g + 2(4j + k) + t
    q = blocks.q.to(torch.int32).view(tiles, 16, groups, 4, 4, 2)
    words = q[..., 0, :] | (q[..., 1, :] << 4) | (q[..., 2, :] << 8) | (q[..., 3, :] << 12)
    words = words.permute(0, 2, 3, 1, 4).to(torch.uint16).contiguous()  # [tile, g, j, l, t]
    scale = blocks.scale.float()
    # sum W x = scale dot(128 + q, x) + bias sum(x)
    second = blocks.offset.float() if half else blocks.offset.float() - 128 * scale
    dtype = torch.float16 if half else torch.float32
    return torch.cat([words.view(torch.uint8).view(tiles, groups, NIBBLE_BYTES),
                      _per_tile(scale.to(dtype), tiles, groups),
                      _per_tile(second.to(dtype), tiles, groups)], dim=2).contiguous()


def _half_tiles(blocks: Int4Blocks, half: bool | None) -> bool:
    """Whether tiles hold the scales and offsets in float16: asked (only
    where exact), or where exact."""
    if half is None:
        return fp16_exact(blocks)
    if half and not fp16_exact(blocks):
        raise ValueError("float16 tiles need scales and offsets float16 holds exactly")
    return half


def int8x_stream(blocks: Int4Blocks, half: bool | None = None) -> torch.Tensor:
    """int8x_gemv's operand for int4 blocks (kernels/cpu/int4_gemv.cpp),
    uint8 [out / 16, in / 32, 320 or 384]: per 16 outputs and group of 32
    inputs, 4 chunks of 16 x 4 bytes (byte 4l + t of chunk j holds q[l][8j + t]
    in its low nibble, q[l][8j + 4 + t] in its high one), then the 16 scales
    and the 16 offsets, in float16 where it holds them exactly (fp16_exact),
    else fp32. (half: force the one or the other; float16 only where exact.)"""
    half = _half_tiles(blocks, half)
    out_features, in_features = blocks.q.shape
    tiles, groups = out_features // 16, in_features // 32
    # q as [tile, l, group, j, nibble, t]: input 32g + 8j + 4 nibble + t
    q = blocks.q.to(torch.uint8).view(tiles, 16, groups, 4, 2, 4)
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [tile, g, j, l, t]
    dtype = torch.float16 if half else torch.float32
    return torch.cat([packed.reshape(tiles, groups, NIBBLE_BYTES),
                      _per_tile(blocks.scale.float().to(dtype), tiles, groups),
                      _per_tile(blocks.offset.float().to(dtype), tiles, groups)],
                     dim=2).contiguous()


def q8_stream(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8x_gemv's operand for Q8_0 blocks (q int8 [out, in], d float16
    values [out, in / 32]), uint8 [out / 16, in / 32, 544]: per 16 outputs and
    group of 32 inputs, 8 chunks of 16 x 4 bytes (byte 4l + t of chunk j is
    q[l][4j + t] + 128), then the 16 scales d in float16."""
    out_features, in_features = q.shape
    tiles, groups = out_features // 16, in_features // 32
    if not _fp16_values(d):
        raise ValueError("Q8_0 scales must be float16 values")
    levels = (q.to(torch.int16) + 128).to(torch.uint8).view(tiles, 16, groups, 8, 4)
    levels = levels.permute(0, 2, 3, 1, 4).reshape(tiles, groups, 16 * 32)
    return torch.cat([levels, _per_tile(d.float().half(), tiles, groups)], dim=2).contiguous()


def q5_stream(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8x_gemv's operand for levels in -16..15 (GGML's Q5_0 blocks: q
    int8 [out, in], d float16 values [out, in / 32]), uint8 [out / 16, in /
    32, 352]: per 16 outputs and group of 32 inputs, the levels + 16 (0..31):
    their low four bits as int8x_stream lays out nibbles (byte 4l + t of
    chunk j holds input 8j + t of output l in its low nibble, 8j + 4 + t in
    its high one), then 64 bytes of fifth bits (byte 4l + t: bit 2j that of
    input 8j + t, bit 2j + 1 that of input 8j + 4 + t), then the 16 scales d
    in float16."""
    out_features, in_features = q.shape
    tiles, groups = out_features // 16, in_features // 32
    if not _fp16_values(d):
        raise ValueError("Q5_0 scales must be float16 values")
    if q.numel() and (int(q.min()) < -16 or int(q.max()) > 15):
        raise ValueError("q5 tiles hold levels in -16..15")
    # levels as [tile, l, group, j, nibble, t]: input 32g + 8j + 4 nibble + t
    u = (q.to(torch.int16) + 16).to(torch.uint8).view(tiles, 16, groups, 4, 2, 4)
    low = u & 0x0F
    packed = (low[..., 0, :] | (low[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [tile, g, j, l, t]
    shifts = (2 * torch.arange(4).view(4, 1, 1) + torch.arange(2).view(1, 2, 1)).to(torch.uint8)
    fifth = ((u >> 4) << shifts).sum(dim=(3, 4), dtype=torch.uint8)  # [tile, l, g, t]
    return torch.cat([packed.reshape(tiles, groups, NIBBLE_BYTES),
                      fifth.permute(0, 2, 1, 3).reshape(tiles, groups, FIFTH_BIT_BYTES),
                      _per_tile(d.float().half(), tiles, groups)], dim=2).contiguous()


def _per_tile(values: torch.Tensor, tiles: int, groups: int) -> torch.Tensor:
    """[out, groups] values as [tiles, groups, 16 values' bytes]."""
    return values.view(tiles, 16, groups).transpose(1, 2).contiguous().view(torch.uint8)


Q8_GROUP = 32  # inputs per scale of GGML's Q8_0
# Rows up to which the vocabulary projection takes Q8Head on the bf16 int4
# kernel (no AVX-512 VNNI) ...
Q8_HEAD_MAX_ROWS = 8
# ... and where int8x_gemv runs on AMX tiles (from 5 rows). SmolLM2-135M's
# head (49,152 x 576, 2 threads, Intel Xeon with AMX), median us:
#   rows                          8     12     16     24     32
#   Q8Head, AMX                 916  1,015  1,404  2,549  2,810
#   dense bf16 (cpu_linear)   1,435  1,547  1,618  2,003  2,139
Q8_HEAD_AMX_MAX_ROWS = 16
# On vpdpbusd (AVX-512 VNNI, no AMX) it takes every row count: its int8
# products do twice the multiplies an instruction that the dense head's
# bf16 ones do, and read half the bytes. The same head, AMD EPYC, 2
# threads, median ms (docs/BENCHMARKS.md, "q8 tiles at many rows, and the q4
# models' head at every row count"):
#   rows                          8     16     32     96    288
#   Q8Head, vpdpbusd          1.136  1.747  3.347  9.517 28.498
#   dense bf16 (cpu_linear)   1.682  2.518  4.674 14.007 41.286


def amx_int8() -> bool:
    """int8x_gemv runs q8 products of 5 rows or more on AMX tiles
    (kernels/cpu/int4_gemv.cpp): the CPU has them and Linux lends them."""
    kernels: Any = bf16_kernels()
    return kernels is not None and bool(kernels.has_amx_int8())


class Q8Head(nn.Module):
    """The vocabulary projection of a few rows on its own Q8_0 blocks
    (q int8, d per 32: a GGUF's token embedding, tied to the LM head, read
    from the file), weights exact (the file's d·q, not rounded to bf16 as
    the dense head is). Where the CPU has AVX-512 VNNI (int8x_kernels), x is
    taken to int8 and the blocks multiplied as they are (q8_stream: 8.5 bits
    a weight); else on the bf16 int4 kernel: q + 128 = 16·hi + lo with hi,
    lo in 0..15, so that

        W x = [16d·hi − 128d | d·lo] [x | x],

    one int4 product over twice the inputs (10 bits a weight: two nibbles,
    and each half's fp16 scale and offset per 32). The dense bf16 head reads
    16; bench/quantization.py measures it against the dense head (head_alone,
    and the step with it set aside)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, int8x: bool = True) -> None:
        super().__init__()
        rows, cols = q.shape
        self.out_features, self.in_features = rows, cols
        self.int8x = int8x and int8x_kernels()
        self.amx = self.int8x and amx_int8()
        if self.int8x:
            tiles = q8_stream(q, d)
        else:
            levels = q.to(torch.int32) + 128
            blocks = Int4Blocks(torch.cat([levels >> 4, levels & 15], dim=1).to(torch.uint8),
                                torch.cat([16 * d, d], dim=1),
                                torch.cat([-128 * d, torch.zeros_like(d)], dim=1), Q8_GROUP)
            tiles = int4_stream(blocks)
        self.register_buffer("tiles", tiles, persistent=False)

    @staticmethod
    def usable(out_features: int, in_features: int) -> bool:
        """Whether the native int4 kernel takes a head of this shape."""
        return (bf16_kernels() is not None and out_features % OUT_MULTIPLE == 0
                and in_features % Q8_GROUP == 0)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether it computes these rows: any number on vpdpbusd without
        AMX (there it is faster than the dense head at every count), or
        where products are row-invariant (its kernels sum each row alone,
        so that the dense head never takes some of a sequence's rows)."""
        rows = x.shape[0]
        if self.amx:
            limit = max(Q8_HEAD_MAX_ROWS, Q8_HEAD_AMX_MAX_ROWS)
        else:
            limit = rows if self.int8x else Q8_HEAD_MAX_ROWS
        return x.dtype == KERNEL_DTYPE and rows >= 1 and (rows <= limit or row_invariant_on())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] bf16 -> [rows, out_features] bf16."""
        kernels: Any = bf16_kernels()
        if self.int8x:
            y: torch.Tensor = kernels.int8x_gemv(x.contiguous(), self.tiles)
        else:
            y = kernels.int4_gemv(torch.cat([x, x], dim=1), self.tiles)
        return y


class Q8Linear(nn.Module):
    """A linear layer on int8 levels with one float16 scale per 32 inputs
    (w = d·q): a GGUF's Q8_0 blocks, and its Q5_0 and Q4_0 ones, whose
    levels (q − 16, q − 8) fit int8 exactly. x is taken to int8 per 32 and
    the levels multiplied as they are (int8x_gemv: vpdpbusd, and AMX tiles
    from 5 rows where the CPU has them), 8.5 bits a weight read where the
    dense bf16 copy would read 16; levels that all lie in -16..15 (Q5_0's,
    Q4_0's) as q5 tiles, 5.5 bits a weight, as the file stores Q5_0, where
    the CPU has no AMX (whose tiles take q8 ones for many rows). The same
    call shape as layers.linear.Linear: x [rows, in_features] ->
    [rows, out_features]. Needs int8x_kernels()."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        q5 = bool(not cpu.has_amx() and q.numel() and int(q.min()) >= -16 and int(q.max()) <= 15)
        self.register_buffer("tiles", q5_stream(q, d) if q5 else q8_stream(q, d),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels: Any = bf16_kernels()
        y: torch.Tensor = kernels.int8x_gemv(x.to(KERNEL_DTYPE).contiguous(), self.tiles)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def q5(self) -> bool:
        """Whether the tiles are q5_stream's (else q8_stream's)."""
        return self.tiles.shape[-1] == Q5_TILE_BYTES

    def direct_product(self, rows: int) -> Product | None:
        """The kernel call for x of `rows` bf16 rows (layers/native_stack.py)."""
        if self.bias is not None:
            return None
        kernels: Any = bf16_kernels()
        return kernels.int8x_gemv.default, (self.tiles,)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] its tiles hold (q8_stream's or
        q5_stream's read back): d·q, exact."""
        tiles, groups = self.tiles.shape[0], self.tiles.shape[1]
        if self.q5:
            # [tile, g, j, l, t] nibbles and [tile, g, l, t] fifth bits
            packed = self.tiles[..., :NIBBLE_BYTES].view(tiles, groups, 4, 16, 4)
            fifth = self.tiles[..., NIBBLE_BYTES : NIBBLE_BYTES + FIFTH_BIT_BYTES]
            fifth = fifth.view(tiles, groups, 1, 16, 4)
            j = torch.arange(4).view(1, 1, 4, 1, 1)
            low = torch.stack([packed & 0x0F, packed >> 4], dim=4)  # [tile, g, j, l, nibble, t]
            bits = torch.stack([(fifth >> (2 * j)) & 1, (fifth >> (2 * j + 1)) & 1], dim=4)
            u = (low + (bits << 4)).permute(0, 3, 1, 2, 4, 5)  # [tile, l, g, j, nibble, t]
            q = u.reshape(self.out_features, self.in_features).to(torch.int16) - 16
            scales = self.tiles[..., NIBBLE_BYTES + FIFTH_BIT_BYTES :]
        else:
            levels = self.tiles[..., :512].view(tiles, groups, 8, 16, 4).permute(0, 3, 1, 2, 4)
            q = levels.reshape(self.out_features, self.in_features).to(torch.int16) - 128
            scales = self.tiles[..., 512:]
        d = scales.contiguous().view(torch.float16).view(tiles, groups, 16)
        d = d.permute(0, 2, 1).reshape(self.out_features, groups).float()
        w = q.float().view(self.out_features, groups, Q8_GROUP) * d[..., None]
        return w.view(self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: the tiles (levels and scales), the bias."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return int(self.tiles.numel() + bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel=int8x {'q5' if self.q5 else 'q8'}")


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
