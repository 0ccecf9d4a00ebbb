"""A GGUF tensor as stored, and its dense values: F32/F16/BF16 as they are,
the quantized types dequantized to fp32 exactly as gguf.quants does (the
values llama.cpp computes with)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specpage.models.config import ModelLoadError

FLOAT_TYPES = ("F32", "F16", "BF16")  # kept as stored
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # dequantized
SUPPORTED_TYPES = FLOAT_TYPES + QUANTIZED_TYPES


@dataclass(frozen=True)
class RawTensor:
    """A tensor as the file stores it, rows in the HF checkpoint's order."""

    name: str  # the GGUF name
    type_name: str  # GGML type: "Q4_K", "F32", ...
    shape: tuple[int, ...]  # HF order: [rows, cols], or [cols] for a vector
    data: np.ndarray  # [rows, bytes per row] uint8


def dequantize(raw: RawTensor, path: Path) -> torch.Tensor:
    import gguf

    if raw.type_name not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{path}: GGUF tensor {raw.name} is {raw.type_name}; supported "
                             f"types: {', '.join(SUPPORTED_TYPES)}")
    if raw.type_name == "BF16":  # numpy has no bfloat16: reinterpret in torch
        bits = torch.from_numpy(np.array(raw.data).view(np.int16))
        return bits.view(torch.bfloat16).reshape(raw.shape)
    if raw.type_name in FLOAT_TYPES:
        values = np.array(raw.data).view(np.float32 if raw.type_name == "F32" else np.float16)
        return torch.from_numpy(values).reshape(raw.shape)
    if raw.type_name in LEGACY_BLOCKS:
        return LEGACY_BLOCKS[raw.type_name](_blocks(raw)).reshape(raw.shape)
    values = gguf.quants.dequantize(raw.data, gguf.GGMLQuantizationType[raw.type_name])
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(raw.shape)


# Q8_0, Q4_0 and Q4_1 dequantized over the whole tensor at once, in torch:
# the same fp32 operations in the same order as gguf.quants (so the same
# values), without its per-chunk Python loop, which took most of the load
# time of a Q4_1 file (the default SmolLM2's).
BLOCK = 32  # weights per Q8_0/Q4_0/Q4_1 block


def _blocks(raw: RawTensor) -> torch.Tensor:
    """[rows, blocks per row, bytes per block] uint8."""
    rows = raw.data.shape[0]
    blocks_per_row = raw.shape[-1] // BLOCK
    return torch.from_numpy(np.array(raw.data)).view(rows, blocks_per_row, -1)  # a copy: writable


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of each block, as fp32: [rows, blocks, 1]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """fp32 4-bit values [rows, blocks, 32] of the packed bytes [rows, blocks,
    16], in GGML order: weight j in the low nibble of byte j, j + 16 in its
    high one. Written into one buffer, which the callers scale in place."""
    values = torch.empty(*packed.shape[:-1], BLOCK)
    values[..., :BLOCK // 2] = packed & 0x0F
    values[..., BLOCK // 2:] = packed >> 4
    return values


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[..., 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles(blocks[..., 2:]).sub_(8).mul_(_half(blocks, 0))  # small integers: exact


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # a separate multiply and add, as gguf.quants: no fused rounding
    return _nibbles(blocks[..., 4:]).mul_(_half(blocks, 0)).add_(_half(blocks, 2))


LEGACY_BLOCKS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}
