"""Choosing and applying weight-only quantization to a loaded model.

    none   the weights as loaded (fp32 on CPU): the exact path
    q4     int4, group 32 (q4-g64, q4-g128: larger groups). From a Q4_0/Q4_1
           GGUF its own blocks, and from a GGUF whose linears are all
           K-quants (Q4_K, Q5_K, Q6_K: any _K_M or _K_S file whose every
           linear takes 256-wide super-blocks) those blocks on their own
           kernels (layers/kquant.py); from a GGUF that mixes those with
           int8 levels (Q8_0, and Q5_0, which a _K_M file uses where a
           width is no multiple of 256: Gemma 3 270M's), each projection
           on its own kind's blocks (layers/quant.py Q8Linear for the int8
           levels, where the CPU has AVX-512 VNNI; q5 tiles for a
           projection all of Q5_0, where it has no AMX); otherwise
           round-to-nearest from the loaded weights, cached under
           <cache>/quantized/
    q8     refused: torch's CPU int8 weight-only kernel is slower than q4 here,
           and not consistently faster than fp32 (quant_names.Q8_REFUSED)
    auto   q4 where the checkpoint is a GGUF whose linears run on their
           blocks as above (nothing is re-quantized), else none

Only each layer's qkv_proj, o_proj, gate_up_proj and down_proj are swapped,
after loading (an EAGLE-3 head's too, with its fc and its LM head over the
draft vocabulary, by q4 only: a head is no GGUF, so auto leaves it); norms,
the embedding and the KV cache stay in the activation dtype (bf16 for a
quantized model unless a dtype is asked for). The tied embedding / LM head
stays dense in that dtype: on the vocabulary projection alone that was
measured the better choice than fp32 or torch's int8 kernel (one scale per
row, which would re-quantize the GGUF's Q8_0 blocks; docs/BENCHMARKS.md,
"Quantized linears: the vocabulary projection"). Where the head is a
GGUF's Q8_0 blocks (the default file's), q4 also gives the model a Q8Head
(layers/quant.py): those blocks, exact, for up to 8 rows, where it was
measured faster than the dense bf16 head (the same section); more rows take
the dense head. A model computing in bf16 takes each product's input to int8 per group
of 32 where the CPU has AVX-512 VNNI (layers.quant.INT8X_PRODUCTS, as llama.cpp
does); one computing in a chosen fp32 keeps them bf16.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specpage.layers.kquant import FORMATS as KQUANT_FORMATS
from specpage.layers.kquant import KQuantBlocks, KQuantHead, KQuantLinear
from specpage.layers.quant import (
    GROUP_SIZES,
    KERNEL_DTYPE,
    OUT_MULTIPLE,
    Q_OFFSET,
    Int4Blocks,
    Int4Linear,
    Q8Head,
    Q8Linear,
    int8x_kernels,
)
from specpage.models.gguf_blocks import FORMATS, GGUF_PARTS, GGUFWeights
from specpage.models.gguf_dequant import RawTensor
from specpage.models.gguf_file import GGUFFile, gguf_of
from specpage.models.quant_names import Quantization, QuantizationError

if TYPE_CHECKING:
    from specpage.models.config import ModelConfig
    from specpage.models.decoder import DecoderModel
    from specpage.models.eagle3 import LoadedHead


class Loaded(Protocol):
    """What quantization reads of loader.LoadedModel (a frozen dataclass,
    named structurally here so this module does not import the loader)."""

    model: DecoderModel
    config: ModelConfig
    folder: Path
    identity: bytes


L = TypeVar("L", bound=Loaded)
H = TypeVar("H", bound="Loaded | LoadedHead")

log = logging.getLogger(__name__)

GGUF_GROUP = 32  # inputs per Q4_0/Q4_1 block
# The activation dtype of a quantized model on CPU when none is asked for:
# faster than casting each product's input from fp32, at about fp32's
# perplexity (docs/BENCHMARKS.md, "quantization": q4 against q4 with fp32
# activations).
QUANTIZED_DTYPE = torch.bfloat16
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})  # GGUF linears q4 may quantize itself
CACHE_VERSION = 1  # bump when the cached layout changes


def gguf_source(path: Path, folder: Path) -> Path | None:
    """The GGUF a checkpoint came from: the path itself (or the file a GGUF's
    metadata folder was made from), or the cached file a converted folder
    names (specpage-source.json, written by convert_gguf), when it is still
    there with the recorded digest."""
    from specpage.models.fetch import SOURCE_FILE, cache_dir, sha256_file

    direct = gguf_of(path)
    if direct is not None:
        return direct
    record = folder / SOURCE_FILE
    if not record.is_file():
        return None
    source = json.loads(record.read_text())
    candidate = cache_dir() / "gguf" / str(source.get("gguf_file", ""))
    if candidate.is_file() and sha256_file(candidate) == source.get("gguf_sha256"):
        return candidate
    log.warning("GGUF source of %s not in the cache (%s); q4 quantizes its fp32 weights",
                folder, candidate)
    return None


def reusable(linear_types: set[str]) -> bool:
    """Whether linears of these GGML types run on the GGUF's own blocks:
    all Q4_0/Q4_1 (int4 groups), all K-quants (their own kernels), or a
    mix of those and of int8 levels (Q8_0, Q5_0: Q8Linear, where the CPU
    has the int8 products), each projection of one kind (_swap_mixed)."""
    if not linear_types:
        return False
    if linear_types <= FORMATS.keys() or linear_types <= KQUANT_FORMATS.keys():
        return True
    return (linear_types <= FORMATS.keys() | KQUANT_FORMATS.keys() | Q8_LEVELS.keys()
            and int8x_kernels())


def runs_on_gguf_blocks(quantization: Quantization, linear_types: set[str]) -> bool:
    """Whether quantize_loaded swaps every linear of a GGUF whose linears are
    of these types for the file's blocks: then the loader need not
    dequantize them."""
    return quantization.kind in ("auto", "q4") and reusable(linear_types)


def quantize_loaded(loaded: L, quantization: Quantization, path: Path,
                    dtype_chosen: bool) -> L:
    """``loaded`` with its projections swapped for Int4Linear (in place), its
    identity told apart from the unquantized model's, and what was applied
    recorded ("q4 from GGUF Q4_1 blocks", "q4 g32 round-to-nearest").

    Unless the caller chose a dtype, a quantized model on CPU computes in
    bf16 (QUANTIZED_DTYPE): the kernel's input dtype, so no cast around each
    product, and the vocabulary projection reads half the bytes."""
    if quantization.kind == "none":
        return loaded
    gguf = gguf_source(path, loaded.folder)
    weights = GGUFWeights(gguf, loaded.config) if gguf is not None else None
    types = weights.linear_types() if weights is not None else set()
    reuse = weights is not None and reusable(types)
    if quantization.kind == "auto":
        if not reuse:
            return loaded
        quantization = Quantization("q4", GGUF_GROUP)
    if weights is not None and not reuse and types - FLOAT_TYPES:
        raise QuantizationError(
            f"{gguf}: q4 reuses Q4_0/Q4_1 blocks or quantizes float weights; this GGUF's "
            f"linears are {', '.join(sorted(types))} "
            f"({', '.join(sorted(types - FLOAT_TYPES - FORMATS.keys()))} unsupported)")
    if reuse and quantization.group != GGUF_GROUP:
        raise QuantizationError(
            f"{gguf}: its Q4 blocks are groups of {GGUF_GROUP}; q4-g{quantization.group} would "
            "re-quantize weights already quantized: use q4")
    # bf16 activations (Q8Head's, and int8 product inputs'): the default, or chosen
    bf16 = bf16_activations(loaded, dtype_chosen)
    if reuse and not types <= FORMATS.keys():
        assert gguf is not None and weights is not None
        file = GGUFFile(gguf)
        _swap_mixed(loaded.model, file, weights, bf16)
        applied = f"GGUF {'/'.join(sorted(types))} blocks" + _head_on_blocks(
            loaded.model, weights, bf16, file)
    elif reuse:
        assert weights is not None
        _swap(loaded.model, weights.blocks, int8x=bf16)
        applied = (f"q4 from GGUF {'/'.join(sorted(types))} blocks"
                   + _head_on_blocks(loaded.model, weights, bf16))
    else:
        blocks = _rtn_cached(loaded, quantization.group)
        _swap(loaded.model, lambda i, name: blocks[f"layers.{i}.{name}"], int8x=bf16)
        applied = f"q4 g{quantization.group} round-to-nearest"
    return _applied(loaded, applied, dtype_chosen)


def _applied(loaded: H, applied: str, dtype_chosen: bool) -> H:
    """A model or head whose linears were just swapped: computing in bf16
    unless the caller chose a dtype, its identity told apart from the
    unquantized one's, and what was applied recorded."""
    model = loaded.model
    if not dtype_chosen and model.inv_freq.device.type == "cpu":
        inv_freq = model.inv_freq  # fp32 whatever the weights' dtype, as HF keeps it
        model.to(QUANTIZED_DTYPE)
        model.inv_freq = inv_freq
    if model.norm.weight.dtype == QUANTIZED_DTYPE:
        applied += ", bf16 activations"
    if any(isinstance(m, Int4Linear) and m.int8x or isinstance(m, KQuantLinear | Q8Linear)
           for m in model.modules()):
        applied += ", int8 product inputs"  # x to int8 per 32 at each product (layers/quant.py)
    log.info("quantized %s: %s", loaded.folder, applied)
    identity = hashlib.sha256(loaded.identity + applied.encode()).digest()
    return dataclasses.replace(loaded, identity=identity, quantization=applied)


PROJECTIONS = tuple(GGUF_PARTS)  # qkv_proj, o_proj, gate_up_proj, down_proj
HEAD_PROJECTIONS = ("fc", *PROJECTIONS, "lm_head")


def quantize_head(head: LoadedHead, quantization: Quantization,
                  dtype_chosen: bool) -> LoadedHead:
    """An EAGLE-3 head with its linears swapped for Int4Linear, round to
    nearest from its weights (a head is small: ~10M weights, quantized in
    well under a second, so nothing is cached), computing in bf16 unless
    the caller chose a dtype, as a quantized target does."""
    if quantization.kind != "q4":
        return head
    for name in HEAD_PROJECTIONS:
        dense = getattr(head.model, name)
        bias = None if dense.bias is None else dense.bias.detach()
        setattr(head.model, name, Int4Linear(quantize_rtn(dense.weight, quantization.group, name),
                                             bias, int8x=bf16_activations(head, dtype_chosen)))
    return _applied(head, f"q4 g{quantization.group} round-to-nearest", dtype_chosen)


def bf16_activations(loaded: Loaded | LoadedHead, dtype_chosen: bool) -> bool:
    """Whether a model quantized now computes in bf16: unless a dtype was
    chosen (then the one it was loaded in), _applied casts it so."""
    return not dtype_chosen or loaded.model.norm.weight.dtype == QUANTIZED_DTYPE


def _swap(model: DecoderModel, blocks_of: Callable[[int, str], Int4Blocks],
          int8x: bool) -> None:
    """Each projection swapped for its blocks; int8x: their products may
    take x to int8 (quant.Int4Linear), which a model computing in fp32 does not."""
    for i, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            dense = getattr(layer, name)
            blocks = blocks_of(i, name)
            if tuple(blocks.q.shape) != tuple(dense.weight.shape):
                raise QuantizationError(f"layers.{i}.{name}: quantized weight is "
                                        f"{tuple(blocks.q.shape)}, the model's "
                                        f"{tuple(dense.weight.shape)}")
            out_features, in_features = blocks.q.shape
            check_shape(f"layers.{i}.{name}", in_features, blocks.group, out_features)
            bias = None if dense.bias is None else dense.bias.detach()
            setattr(layer, name, Int4Linear(blocks, bias, int8x))


def _head_on_blocks(model: DecoderModel, weights: GGUFWeights, bf16: bool,
                    file: GGUFFile | None = None) -> str:
    """The vocabulary projection (the tied embedding, or the output weight)
    on the file's blocks where the model computes in bf16 (a chosen fp32
    keeps the dense head): a Q8Head on Q8_0 blocks, a KQuantHead on K-quant
    ones; what was applied, to be recorded. file: the GGUF already open, if
    it is."""
    name = "token_embd.weight" if model.lm_head is None else "output.weight"
    if not bf16 or name not in weights.tensors:
        return ""
    kind = weights.type_of(name)
    if kind == "Q8_0":
        head = weights.q8_0(name)
        if head is None or not Q8Head.usable(*head[0].shape):
            return ""
        model.q8_head = Q8Head(*head)
        return ", Q8_0 vocabulary projection"
    if kind not in KQUANT_FORMATS:
        return ""
    raw = (file or GGUFFile(weights.path)).raw(name)
    blocks = KQuantBlocks.from_gguf(raw.name, raw.type_name, raw.data)
    if (blocks.rows, blocks.cols) != (model.config.vocab_size, model.config.hidden_size):
        raise QuantizationError(f"{weights.path}: {name} is {blocks.rows} x {blocks.cols}, the "
                                f"model's vocabulary projection {model.config.vocab_size} x "
                                f"{model.config.hidden_size}")
    model.q8_head = KQuantHead([blocks])
    if model.lm_head is not None and model.inv_freq.device.type == "cpu":
        # Its dense copy is then never read to compute logits: a placeholder
        # of its shape holds no memory (one zero of the dtype the model is
        # about to take, expanded), and DecoderModel dequantizes the blocks
        # where a draft's restricted vocabulary asks for rows of it.
        model.lm_head.weight = torch.nn.Parameter(
            torch.zeros((), dtype=QUANTIZED_DTYPE).expand(blocks.rows, blocks.cols),
            requires_grad=False)
    return f", {kind} vocabulary projection"


# GGML types whose blocks of 32 are a float16 d, first, and levels that fit
# int8 exactly (w = d·level): Q8_0's q, Q5_0's q − 16, Q4_0's q − 8
Q8_LEVELS = {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18}  # bytes per block


def q8_levels(raw: RawTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels int8 [rows, cols], d fp32 [rows, cols / 32]) of a tensor of a
    Q8_LEVELS type, read from its blocks as GGML lays them out (w = d·level,
    as its dequantization computes): Q8_0's 32 int8; Q4_0's 16 bytes of
    nibbles, low nibbles the block's first 16 values, less 8; Q5_0's four
    bytes of fifth bits (bit j for value j) before those nibbles, less 16."""
    rows, cols = raw.shape
    blocks = np.ascontiguousarray(raw.data).reshape(rows, cols // GGUF_GROUP,
                                                    Q8_LEVELS[raw.type_name])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if raw.type_name == "Q8_0":
        levels = blocks[..., 2:].view(np.int8)
    else:
        packed = blocks[..., -16:]
        nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int16)
        if raw.type_name == "Q4_0":
            levels = nibbles - 8
        else:
            high = blocks[..., 2:6].copy().view("<u4")  # [rows, blocks, 1]
            bits = (high >> np.arange(GGUF_GROUP, dtype=np.uint32)) & 1
            levels = nibbles + (bits.astype(np.int16) << 4) - 16
    q = torch.from_numpy(np.ascontiguousarray(levels, dtype=np.int8).reshape(rows, cols))
    return q, torch.from_numpy(d)


def _swap_mixed(model: DecoderModel, gguf: GGUFFile, weights: GGUFWeights, int8x: bool) -> None:
    """Each projection swapped for a module on the file's blocks, by its
    parts' types (q, k, v; gate, up): K-quants (any mix of them) a
    KQuantLinear; Q4_0/Q4_1 an Int4Linear; int8 levels (Q8_0, Q5_0, with
    Q4_0) a Q8Linear. A projection that mixes those kinds is refused by name."""
    for i, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            dense = getattr(layer, name)
            raws = gguf.projection_parts(i, name)
            types = {raw.type_name for raw in raws}
            bias = None if dense.bias is None else dense.bias.detach()
            module: torch.nn.Module
            if types <= KQUANT_FORMATS.keys():
                parts = [KQuantBlocks.from_gguf(raw.name, raw.type_name, raw.data)
                         for raw in raws]
                module, shape = KQuantLinear(parts, bias), (sum(p.rows for p in parts),
                                                            parts[0].cols)
            elif types <= FORMATS.keys():
                blocks = weights.blocks(i, name)
                check_shape(f"layers.{i}.{name}", blocks.q.shape[1], GGUF_GROUP,
                            blocks.q.shape[0])
                module, shape = Int4Linear(blocks, bias, int8x), tuple(blocks.q.shape)
            elif types <= Q8_LEVELS.keys():  # int8 inputs whatever the model's dtype
                levels = [q8_levels(raw) for raw in raws]
                q, d = torch.cat([q for q, _ in levels]), torch.cat([d for _, d in levels])
                check_shape(f"layers.{i}.{name}", q.shape[1], GGUF_GROUP, q.shape[0])
                module, shape = Q8Linear(q, d, bias), tuple(q.shape)
            else:
                raise QuantizationError(
                    f"{gguf.path}: layers.{i}.{name}'s parts are {', '.join(sorted(types))}: "
                    "one projection runs on K-quant, Q4_0/Q4_1 or int8-level (Q8_0, Q5_0) "
                    "blocks, not a mix; load it with --quantization none")
            if shape != tuple(dense.weight.shape):
                raise QuantizationError(f"layers.{i}.{name}: the GGUF's blocks are {shape}, "
                                        f"the model's weight {tuple(dense.weight.shape)}")
            setattr(layer, name, module)


def _rtn_cached(loaded: Loaded, group: int) -> dict[str, Int4Blocks]:
    """Round-to-nearest blocks of every projection, read from the cache when
    this checkpoint (by identity) was quantized before."""
    from specpage.models.fetch import cache_dir

    name = f"{loaded.identity.hex()[:32]}-q4-g{group}-v{CACHE_VERSION}.safetensors"
    path = cache_dir() / "quantized" / name
    if path.is_file():
        return _read_blocks(path, group)
    blocks = {f"layers.{i}.{name}": quantize_rtn(getattr(layer, name).weight, group,
                                                  f"layers.{i}.{name}")
              for i, layer in enumerate(loaded.model.layers) for name in PROJECTIONS}
    _write_blocks(path, blocks)
    return blocks


def check_shape(name: str, in_features: int, group: int, out_features: int) -> None:
    if group not in GROUP_SIZES:
        raise QuantizationError(f"{name}: q4 group size {group} unsupported; "
                                f"use one of {', '.join(map(str, GROUP_SIZES))}")
    if in_features % group:
        raise QuantizationError(f"{name}: q4 needs in_features a multiple of the group size "
                                f"{group}; this weight has {in_features} inputs")
    if out_features % OUT_MULTIPLE:
        raise QuantizationError(f"{name}: q4 needs out_features a multiple of {OUT_MULTIPLE}; "
                                f"this weight has {out_features} outputs")


def quantize_rtn(weight: torch.Tensor, group: int = 32, name: str = "weight") -> Int4Blocks:
    """Round-to-nearest asymmetric group-wise int4, as gpt-fast does: per
    group, the 16 levels span [min, max]. The scale and zero are rounded to
    the kernel's bf16 first and q chosen against the rounded values, so the
    kernel computes exactly what was chosen."""
    rows, cols = weight.shape
    check_shape(name, cols, group, rows)
    w = weight.detach().float().view(rows, cols // group, group)
    low, high = w.amin(-1), w.amax(-1)
    levels = 2**4 - 1
    scale = ((high - low) / levels).clamp(min=1e-8).to(KERNEL_DTYPE).float()
    zero = (low + Q_OFFSET * scale).to(KERNEL_DTYPE).float()
    offset = zero - Q_OFFSET * scale  # the value q = 0 stands for
    q = ((w - offset[..., None]) / scale[..., None]).round().clamp(0, levels)
    return Int4Blocks(q.to(torch.uint8).view(rows, cols), scale, offset, group)


def _write_blocks(path: Path, blocks: dict[str, Int4Blocks]) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for key, b in blocks.items():
        tensors[f"{key}.q"] = b.q[:, 0::2] | (b.q[:, 1::2] << 4)  # two values a byte
        tensors[f"{key}.scale"], tensors[f"{key}.offset"] = b.scale, b.offset
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)  # atomic: a crash never leaves half a cache file under the real name


def _read_blocks(path: Path, group: int) -> dict[str, Int4Blocks]:
    tensors = load_file(str(path))
    blocks = {}
    for key in {name.rsplit(".", 1)[0] for name in tensors}:
        packed = tensors[f"{key}.q"]
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)
        blocks[key] = Int4Blocks(q, tensors[f"{key}.scale"], tensors[f"{key}.offset"], group)
    return blocks
