"""A GGUF's 4-bit weights as they are stored: per block of 32 inputs, 4-bit
values ``q`` with a scale ``d`` and (Q4_1) a minimum ``m``.

    Q4_0: w = d·(q − 8)        Q4_1: w = d·q + m        (d, m: float16)

These are read without ever going through fp32 weights, so a model loaded
from a Q4_0/Q4_1 GGUF runs the file's own 4-bit values (see
specpage.layers.quant). Rows are in the order of the HF checkpoint the fp32
path loads: llama.cpp stores a Llama's q/k rows permuted for its rope, and
transformers un-permutes them on conversion; we permute the same rows, which
moves whole blocks and changes no value.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specpage.core.arith import cdiv
from specpage.layers.quant import Int4Blocks
from specpage.models.config import ModelConfig, ModelLoadError
from specpage.models.quant_names import QuantizationError

BLOCK = 32  # inputs per Q4_0/Q4_1 block (GGML's QK4_0, QK4_1)
# GGML type name -> (bytes per block, has a minimum)
FORMATS = {"Q4_0": (2 + BLOCK // 2, False), "Q4_1": (2 + 2 + BLOCK // 2, True)}
Q8_0_BYTES = 2 + BLOCK  # a float16 d, then 32 int8: w = d·q

# our projection -> the GGUF tensors concatenated into it along the output
# rows, in the order loader.hf_to_fused concatenates the HF ones
GGUF_PARTS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}
# GGUF architectures whose q/k rows llama.cpp permuted (transformers'
# TENSOR_PROCESSORS maps these to its LlamaTensorProcessor)
PERMUTED_QK = ("llama",)


def decode_blocks(raw: np.ndarray, type_name: str, name: str) -> Int4Blocks:
    """``raw``: [rows, bytes per row] uint8 as GGUFReader gives it."""
    if type_name not in FORMATS:
        raise QuantizationError(
            f"GGUF tensor {name} is {type_name}; 4-bit weights are read from "
            f"{' and '.join(FORMATS)} blocks only"
        )
    block_bytes, has_min = FORMATS[type_name]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    start = 4 if has_min else 2
    packed = blocks[..., start:]  # [rows, num_blocks, 16]
    # GGML order: element j in the low nibble of byte j, element j+16 in its high one.
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    # Q4_0: d·(q − 8) = d·q − 8d; both products are exact in fp32, so is the sum.
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else -8.0 * d
    scale, offset = torch.from_numpy(d), torch.from_numpy(m)
    return Int4Blocks(torch.from_numpy(np.ascontiguousarray(q)), scale, offset, BLOCK)


def rope_unpermute(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers'
    reverse_permute_weights, applied to row indices)."""
    half = rows // num_heads // 2
    index = torch.arange(rows).view(num_heads, half, 2)
    return index.transpose(1, 2).reshape(rows)


@dataclass(frozen=True)
class TensorInfo:
    type_name: str  # GGML type: "Q4_1", "F32", ...
    shape: tuple[int, ...]  # GGML order: the fastest-varying (input) dimension first
    offset: int  # bytes from the file's start


class GGUFWeights:
    """The 4-bit linear weights of one GGUF, by our fused projection name.

    Reads the header itself: gguf.GGUFReader parses every metadata value,
    the tokenizer's 49k strings included (25 s on a busy 2-core machine),
    where a weight needs only the tensor table."""

    def __init__(self, path: Path, config: ModelConfig) -> None:
        self.path, self.config = path, config
        try:
            self.data = np.memmap(path, dtype=np.uint8, mode="r")
            self.architecture, self.tensors = read_header(self.data)
        except (ValueError, OSError, IndexError) as error:
            raise ModelLoadError(f"{path}: unreadable GGUF ({error})") from None

    def type_of(self, name: str) -> str:
        return self._tensor(name).type_name

    def linear_types(self) -> set[str]:
        """The GGML types of every layer's linear weights."""
        return {self.type_of(f"blk.{i}.{part}.weight")
                for i in range(self.config.num_layers)
                for parts in GGUF_PARTS.values() for part in parts}

    def blocks(self, layer: int, projection: str) -> Int4Blocks:
        parts = []
        for part in GGUF_PARTS[projection]:
            name = f"blk.{layer}.{part}.weight"
            info = self._tensor(name)
            if info.type_name not in FORMATS:
                decode_blocks(self.data[:0], info.type_name, name)  # raises, naming the type
            block_bytes = FORMATS[info.type_name][0]
            cols, rows = info.shape[0], int(np.prod(info.shape[1:]))
            row_bytes = cols // BLOCK * block_bytes
            raw = self.data[info.offset:info.offset + rows * row_bytes].reshape(rows, row_bytes)
            blocks = decode_blocks(raw, info.type_name, name)
            heads = {"attn_q": self.config.num_heads, "attn_k": self.config.num_kv_heads}
            if self.architecture in PERMUTED_QK and part in heads:
                blocks = blocks.take_rows(rope_unpermute(rows, heads[part]))
            parts.append(blocks)
        return parts[0] if len(parts) == 1 else Int4Blocks.cat(parts)

    def q8_0(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q [rows, cols] int8, d [rows, cols / 32] fp32) of a Q8_0 tensor
        (w = d·q, exactly as GGML dequantizes it); None where the tensor is
        of another type."""
        info = self._tensor(name)
        if info.type_name != "Q8_0":
            return None
        cols, rows = info.shape[0], int(np.prod(info.shape[1:]))
        row_bytes = cols // BLOCK * Q8_0_BYTES
        raw = self.data[info.offset:info.offset + rows * row_bytes]
        blocks = np.ascontiguousarray(raw).reshape(rows, cols // BLOCK, Q8_0_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return torch.from_numpy(q), torch.from_numpy(d)

    def _tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: GGUF lacks tensor {name!r}") from None


GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # GGUF's, unless general.alignment says otherwise
# GGUF metadata value type -> struct format of a scalar (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class ArrayRef:
    """A metadata array left unread (the tokenizer's are 49k-262k strings):
    where it lies, to be read only by whoever needs it."""

    item_type: int  # GGUF value type of the items
    count: int
    offset: int  # bytes from the file's start to the first item


@dataclass(frozen=True)
class Header:
    metadata: dict[str, object]  # key -> scalar, string or ArrayRef
    tensors: dict[str, TensorInfo]
    size: int  # bytes before the first tensor's data

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def read_header(data: np.ndarray) -> tuple[str, dict[str, TensorInfo]]:
    """(general.architecture, tensor name -> TensorInfo) of a GGUF file."""
    header = read_gguf_header(data)
    return header.architecture, header.tensors


def read_gguf_header(data: np.ndarray) -> Header:
    """A GGUF file's metadata and tensor table, as the format's spec lays the
    header out (little-endian, version 2 or 3); arrays are skipped, not read."""
    import gguf  # only for the GGML type names

    buf = memoryview(data)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} unsupported")
    pos = 24

    def string() -> str:
        nonlocal pos
        (length,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + length
        return bytes(buf[pos - length:pos]).decode("utf-8", "replace")

    def value(kind: int) -> object:
        nonlocal pos
        if kind == STRING:
            return string()
        if kind == ARRAY:
            item, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            ref = ArrayRef(item, count, pos)
            if item in SCALARS:
                pos += struct.calcsize("<" + SCALARS[item]) * count
            else:
                for _ in range(count):
                    value(item)
            return ref
        fmt = "<" + SCALARS[kind]
        (scalar,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return scalar

    meta: dict[str, object] = {}
    for _ in range(num_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        meta[key] = value(kind)
    infos = []
    for _ in range(num_tensors):
        name = string()
        (dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        infos.append((name, gguf.GGMLQuantizationType(type_id).name, tuple(shape), offset))
    alignment = int(meta.get("general.alignment") or DEFAULT_ALIGNMENT)  # type: ignore[call-overload]
    start = cdiv(pos, alignment) * alignment
    tensors = {name: TensorInfo(type_name, shape, start + offset)
               for name, type_name, shape, offset in infos}
    return Header(meta, tensors, start)
