"""GGML's K-quant weights (Q4_K, Q5_K, Q6_K) as a GGUF stores them, and a
linear layer that multiplies them without unpacking them first.

Each row of a weight is a run of super-blocks of 256 inputs (GGML's QK_K):

    Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and
          mins m[8] packed, 128 bytes of 4-bit q;   w = d·sc[s]·q − dmin·m[s]
    Q5_K, 176 bytes: as Q4_K with 32 bytes of fifth bits before the nibbles
    Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs,
          16 int8 scales, fp16 d;                     w = d·sc[g]·(q − 32)

(s: the sub-block of 32 inputs, g: of 16). `dequantize` computes these in
fp32 as gguf-py's gguf.quants does, value for value.

A KQuantLinear's product runs on the native kernels where they are built
(kernels/cpu/kquant_gemv.cpp: x taken to int8 per row and super-block, as
llama.cpp's Q8_K, the weights' levels summed against it exactly in int32,
the blocks' bytes laid out once at load as tiles of 16 outputs, so that a
vector holds four inputs of each); elsewhere on the weights dequantized to
fp32 for each product. A fused
projection (qkv, gate/up) is several GGUF tensors stacked along the
outputs, not necessarily of one type (Q4_K_M stores attn_v and ffn_down as
Q6_K, the rest as Q4_K): the layer keeps each run of one type as its own
blocks and each kernel call writes its columns of one output.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specpage.kernels.cpu import features as cpu
from specpage.kernels.cpu.native import loaded_kernels
from specpage.layers.products import Product, invariant_linear, row_invariant_on

SUPER_BLOCK = 256  # inputs per super-block (GGML's QK_K)
TILE = 16  # outputs per tile of the native kernels' layout (kquant_gemv.cpp kTile)
# Where the CPU has AMX, products of this many rows or more take the weights
# dequantized to bf16 tile by tile and oneDNN's bf16 product on the tiles,
# outside row-invariant mode: the int8 kernels are bound by their
# multiplies past a few rows (bench/kquant.py; docs/BENCHMARKS.md, "K-quant
# products"). Without AMX, oneDNN's bf16 products are the slower for every
# row count (as for the int4 layers: "Quantized linears: the dense copy").
DENSE_FROM_ROWS = 48
DENSE_TILE_BYTES = 4 << 20  # bf16 weights dequantized at a time: a few MB, reused from cache


@dataclass(frozen=True)
class KQuantFormat:
    name: str  # GGML's type name, as a GGUF's tensor info gives it
    ggml_type: int  # GGML's type number (ggml_type), the native kernels' `type`
    block_bytes: int  # bytes per super-block


FORMATS = {f.name: f for f in (KQuantFormat("Q4_K", 12, 144), KQuantFormat("Q5_K", 13, 176),
                               KQuantFormat("Q6_K", 14, 210))}


class UnsupportedBlocks(ValueError):
    """A tensor whose blocks KQuantBlocks does not read."""


@dataclass(frozen=True)
class KQuantBlocks:
    """One weight of ``rows × cols``: each row's super-blocks, the file's bytes."""

    data: torch.Tensor  # [rows, cols / 256 * block_bytes] uint8
    type_name: str  # "Q4_K", "Q5_K" or "Q6_K"

    def __post_init__(self) -> None:
        assert self.type_name in FORMATS, self.type_name
        assert self.data.dtype == torch.uint8 and self.data.dim() == 2
        assert self.data.shape[1] % self.format.block_bytes == 0, self.data.shape

    @classmethod
    def from_gguf(cls, name: str, type_name: str, raw: np.ndarray) -> KQuantBlocks:
        """A GGUF tensor's blocks: ``raw`` [rows, bytes per row] uint8 (a slice
        of the file's memmap, as GGUFReader or models/gguf_blocks.py read it),
        copied into memory."""
        if type_name not in FORMATS:
            raise UnsupportedBlocks(
                f"GGUF tensor {name} is {type_name}; K-quant weights are read from "
                f"{', '.join(FORMATS)} blocks only")
        block_bytes = FORMATS[type_name].block_bytes
        if raw.ndim != 2 or raw.shape[1] % block_bytes:
            raise UnsupportedBlocks(
                f"GGUF tensor {name} ({type_name}): {raw.shape} bytes are not rows of whole "
                f"{block_bytes}-byte super-blocks")
        return cls(torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)), type_name)

    @property
    def format(self) -> KQuantFormat:
        return FORMATS[self.type_name]

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def cols(self) -> int:
        return int(self.data.shape[1]) // self.format.block_bytes * SUPER_BLOCK

    def take_rows(self, order: torch.Tensor) -> KQuantBlocks:
        """These rows in this order (whole rows of blocks: no value changes)."""
        return KQuantBlocks(self.data[order].contiguous(), self.type_name)

    @staticmethod
    def cat(parts: Sequence[KQuantBlocks]) -> KQuantBlocks:
        """Parts of one type and width stacked along the rows."""
        assert len({(p.type_name, p.cols) for p in parts}) == 1, "one type and width"
        return KQuantBlocks(torch.cat([p.data for p in parts]).contiguous(), parts[0].type_name)

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32 [rows, cols], computed as GGML computes it."""
        blocks = self.data.reshape(-1, self.format.block_bytes)
        return DEQUANTIZE[self.type_name](blocks).reshape(self.rows, self.cols)


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 as float16, widened: [n, 1] fp32."""
    return raw.contiguous().view(torch.float16).float()


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes [n, 12] to sc, m [n, 8] fp32: sub-blocks 0-3
    in the low 6 bits of bytes 0-3 (sc) and 4-7 (m); 4-7 in bytes 8-11's
    nibbles, their top 2 bits in the top bits of bytes 0-7."""
    a, b, c = packed.view(-1, 3, 4).unbind(1)
    sc = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=1)
    m = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=1)
    return sc.float(), m.float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes to [n, 8, 32] levels: chunk c's low nibbles are
    sub-block 2c, its high ones 2c + 1."""
    chunks = qs.view(-1, 4, 1, 32)
    return torch.cat([chunks & 15, chunks >> 4], dim=2).view(-1, 8, 32)


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _halves(blocks[:, 0:2]), _halves(blocks[:, 2:4])
    sc, m = _scales_and_mins(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:144]).float()
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).view(-1, SUPER_BLOCK)


def _dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = _halves(blocks[:, 0:2]), _halves(blocks[:, 2:4])
    sc, m = _scales_and_mins(blocks[:, 4:16])
    bits = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high = (blocks[:, 16:48].reshape(-1, 1, 32) >> bits) & 1  # bit s: sub-block s
    q = (_nibbles(blocks[:, 48:176]) | (high << 4)).float()
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).view(-1, SUPER_BLOCK)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low = blocks[:, 0:128].reshape(-1, 2, 1, 64)  # per half of 128 values
    low = torch.cat([low & 15, low >> 4], dim=2).reshape(-1, SUPER_BLOCK)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, SUPER_BLOCK)
    q = ((low | (high << 4)).to(torch.int8) - 32).float().view(-1, 16, 16)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _halves(blocks[:, 208:210])
    return ((d * scales)[..., None] * q).view(-1, SUPER_BLOCK)


DEQUANTIZE = {"Q4_K": _dequantize_q4_k, "Q5_K": _dequantize_q5_k, "Q6_K": _dequantize_q6_k}


@functools.cache
def kquant_kernels() -> Any:
    """The native kernels where they are built (kernels/cpu/kquant_gemv.cpp;
    their vector path where the CPU has AVX-512 VNNI, a portable one
    elsewhere), else None."""
    kernels = loaded_kernels()
    return kernels if kernels is not None and hasattr(kernels, "kquant_gemv") else None


def runs_of_one_type(parts: Sequence[KQuantBlocks]) -> list[KQuantBlocks]:
    """Neighbouring parts of one type joined: one kernel call each."""
    runs: list[list[KQuantBlocks]] = []
    for part in parts:
        if runs and runs[-1][0].type_name == part.type_name:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [run[0] if len(run) == 1 else KQuantBlocks.cat(run) for run in runs]


class KQuantLinear(nn.Module):
    """A linear layer on K-quant blocks: x [rows, in] (fp32 or bf16) ->
    [rows, out] in x's dtype, out the parts' rows stacked in order (and the
    bias, [out], where given). The same call shape as layers.linear.Linear."""

    def __init__(self, parts: Sequence[KQuantBlocks], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        assert parts, "at least one part"
        assert len({p.cols for p in parts}) == 1, "every part takes the same inputs"
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        runs = runs_of_one_type(parts)
        self.native = kquant_kernels() is not None
        self.dense_tiles = self.native and cpu.has_amx()  # for many rows
        self.tiled = self.native  # the buffers hold kquant_tiles' layout
        self.type_names = [run.type_name for run in runs]
        # (GGML type, first column, outputs) of each run, in order
        self.columns: list[tuple[int, int, int]] = []
        column = 0
        for index, run in enumerate(runs):
            # the native kernels read a run as tiles of 16 outputs (the same
            # bytes, laid out once here); uint8, so no cast of the model's
            # dtype touches them
            data = (kquant_kernels().kquant_tiles(run.data, run.format.ggml_type)
                    if self.tiled else run.data)
            self.register_buffer(f"blocks_{index}", data, persistent=False)
            self.columns.append((run.format.ggml_type, column, run.rows))
            column += run.rows
        # int64, so no cast of the model's dtype touches it
        self.register_buffer("runs", torch.tensor(self.columns, dtype=torch.int64),
                             persistent=False)
        assert bias is None or bias.shape == (self.out_features,), "bias: [out]"
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)

    def _blocks(self) -> list[torch.Tensor]:
        return [getattr(self, f"blocks_{i}") for i in range(len(self.type_names))]

    def takes_dense(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs on bf16 weights dequantized
        tile by tile (AMX, many rows) rather than on the int8 products."""
        return self.dense_tiles and rows >= DENSE_FROM_ROWS and not row_invariant_on()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.native:
            y = self.dequantized_product(x)
        elif self.takes_dense(x.shape[0]):
            y = self.dense_product(x)
        else:
            y = self.int8_product(x, x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def int8_product(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x @ W.T on the native kernels, no bias: x to int8 once for every
        run; in fp32, or each output's fp32 value cast to dtype."""
        kernels = kquant_kernels()
        xq = kernels.kquant_quantize_x(x.contiguous())
        y = torch.empty(x.shape[0], self.out_features,
                        dtype=dtype if dtype == torch.bfloat16 else torch.float32)
        for tiles, (ggml_type, column, rows) in zip(self._blocks(), self.columns, strict=True):
            kernels.kquant_gemv(xq, tiles, ggml_type, rows, y, column)
        return y.to(dtype)

    def dequantized_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T on the weights dequantized to fp32 for this call (where the
        native kernels are not built: slow, but exact in its weights), no bias."""
        weight = self.dequantize()
        product = invariant_linear if row_invariant_on() else F.linear
        return product(x.float(), weight, None).to(x.dtype)

    def dense_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T in bf16 on the native kernels: each run's rows dequantized
        to bf16 some DENSE_TILE_BYTES at a time, each part's product into its
        columns of y (x's dtype), no bias."""
        kernels = kquant_kernels()
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        tiles_at_once = max(1, DENSE_TILE_BYTES // (2 * TILE * self.in_features))
        for tiles, (ggml_type, column, rows) in zip(self._blocks(), self.columns, strict=True):
            for first in range(0, tiles.shape[0], tiles_at_once):
                outputs = min(TILE * tiles_at_once, rows - TILE * first)
                dense = kernels.kquant_dequantize(tiles[first : first + tiles_at_once],
                                                  ggml_type, outputs)
                at = column + TILE * first
                y[:, at : at + outputs] = F.linear(xb, dense)
        return y.to(x.dtype)

    def direct_product(self, rows: int) -> Product | None:
        """The kernel call for x of `rows` bf16 rows where forward takes
        int8_product and there is no bias (layers/native_stack.py): the runs'
        (GGML type, first column), then their blocks; decoder_stack.cpp
        makes int8_product's calls from them."""
        if not self.native or self.bias is not None or self.takes_dense(rows):
            return None
        kernels: Any = kquant_kernels()
        return kernels.kquant_gemv.default, (self.runs, *self._blocks())

    def run_blocks(self) -> list[KQuantBlocks]:
        """Each run's blocks as the GGUF stores them."""
        if not self.tiled:
            return [KQuantBlocks(data, name)
                    for data, name in zip(self._blocks(), self.type_names, strict=True)]
        kernels = kquant_kernels()
        return [KQuantBlocks(kernels.kquant_untile(tiles, ggml_type, rows), name)
                for tiles, (ggml_type, _, rows), name
                in zip(self._blocks(), self.columns, self.type_names, strict=True)]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in], every run's rows in order."""
        return torch.cat([blocks.dequantize() for blocks in self.run_blocks()])

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: the blocks (with a last tile's padding)."""
        return sum(int(b.numel()) for b in self._blocks())

    def extra_repr(self) -> str:
        types = "+".join(f"{name}[{rows}]"
                         for name, (_, _, rows) in zip(self.type_names, self.columns, strict=True))
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"parts={types}, bias={self.bias is not None}, "
                f"kernel={'native' if self.native else 'torch'}, dense_tiles={self.dense_tiles}")


class KQuantHead(KQuantLinear):
    """The vocabulary projection on a GGUF's K-quant blocks (its output
    weight, or the tied embedding), as DecoderModel.logits takes it: x to
    int8 per super-block against the file's exact weights, as llama.cpp
    computes it, into fp32 logits. The dense head reads 2 bytes a weight:
    on the 0.5B Llama-shaped Q4_K_M file of bench/scaling.py, 101 MB a
    token where its Q6_K output weight is 41 MB."""

    # not a Q8Head: the native step leaves it to DecoderModel.logits
    # (models/native_step.py)
    int8x = False

    def takes(self, x: torch.Tensor) -> bool:
        """Any number of rows: forward chooses the product by their count."""
        return x.dim() == 2 and x.shape[0] >= 1 and x.shape[1] == self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> fp32 logits [rows, out_features]: the
        int8 products' fp32 sums as they are, not rounded to x's dtype."""
        if self.native and not self.takes_dense(x.shape[0]):
            return self.int8_product(x)
        return super().forward(x).float()
