"""Llama-shaped GGUF files with random weights, in Q4_K_M as llama.cpp's
quantizer lays it out, for benchmarks of speed only (bench/scaling.py).

A decode step reads every weight whatever its value, so a random model runs
at the speed of a trained one of its shape and format; its answers are
noise. Each file: Q4_K for the linears and token_embd, Q6_K for output.weight
(not tied to the embedding) and for attn_v and ffn_down in the layers
llama.cpp's `use_more_bits` picks (the first and last eighth of the layers
and every third between), F32 norms. Each super-block is random bytes but
for its fp16 scales (Q4_K's d and dmin, Q6_K's d), drawn from BLOCKS' ranges
so that the weights are of a trained model's size and no inf or NaN reaches
the logits. The tokenizer (tokenizer.ggml.* and the chat template) is
SmolLM2-135M-Instruct's, copied from its GGUF. A file is written once into
specpage's cache (bench-scaling/) and reused while the shape, seed and
writer recorded beside it are the same.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specpage.models.fetch import SMOLLM2_GGUF_NAME, cache_dir

SEED = 0
# Bumped whenever write_model writes something else for the same shape and seed.
WRITER_VERSION = 1
SUPER_BLOCK = 256  # inputs per K-quant super-block (GGML's QK_K)
VOCAB = 49152  # SmolLM2's tokenizer
CONTEXT = 8192  # the models' context length (llama.context_length)
ROPE_BASE = 500000.0  # Llama 3's
NORM_EPS = 1e-5
FILE_TYPE_Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M, general.file_type


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int

    def __post_init__(self) -> None:
        assert self.hidden % SUPER_BLOCK == 0 and self.intermediate % SUPER_BLOCK == 0, self
        assert self.hidden % self.heads == 0 and self.heads % self.kv_heads == 0, self

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def parameters(self) -> int:
        """Every weight, the untied embedding and output projection included."""
        h, f = self.hidden, self.intermediate
        layer = 2 * h * h + 2 * h * self.kv_dim + 3 * h * f + 2 * h
        return self.layers * layer + 2 * VOCAB * h + h


# Llama 3.2 1B's and 3B's layer shapes (with SmolLM2's vocabulary), and a
# 0.5B of half the 1B's width and 24 layers.
SHAPES = {
    "0.5b": Shape(hidden=1024, intermediate=4096, layers=24, heads=16, kv_heads=8),
    "1b": Shape(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8),
    "3b": Shape(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8),
}


# GGML type -> (bytes per super-block, offsets of its fp16 scales in a
# block, the range they are drawn from). The ranges give weights of about
# 0.1 on average in both types (Q6_K's int8 sub-block scales are up to 4x
# Q4_K's 6-bit ones), so that a 3B's activations stay far from fp16's range.
BLOCKS = {"Q4_K": (144, (0, 2), (1e-4, 1e-3)), "Q6_K": (210, (208,), (2.5e-5, 2.5e-4))}


def random_blocks(rng: np.random.Generator, type_name: str, rows: int, cols: int) -> np.ndarray:
    """A weight of `rows` x `cols` as random super-blocks with small finite
    scales: [rows, cols / 256 * block_bytes] uint8."""
    block_bytes, scale_offsets, scale_range = BLOCKS[type_name]
    count = rows * cols // SUPER_BLOCK
    blocks = np.frombuffer(rng.bytes(count * block_bytes), np.uint8).reshape(count, block_bytes)
    blocks = blocks.copy()  # frombuffer's view of bytes is read-only
    for offset in scale_offsets:
        scale = rng.uniform(*scale_range, count).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(count, 2)
    return blocks.reshape(rows, cols // SUPER_BLOCK * block_bytes)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp) for Q4_K_M's Q6_K layers."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(shape: Shape) -> list[tuple[str, str, int, int]]:
    """(name, GGML type, rows, cols) of every tensor, in the file's order."""
    h, f, kv = shape.hidden, shape.intermediate, shape.kv_dim
    plan = [("token_embd.weight", "Q4_K", VOCAB, h)]
    for i in range(shape.layers):
        wide = "Q6_K" if use_more_bits(i, shape.layers) else "Q4_K"
        plan += [(f"blk.{i}.attn_norm.weight", "F32", 1, h),
                 (f"blk.{i}.attn_q.weight", "Q4_K", h, h),
                 (f"blk.{i}.attn_k.weight", "Q4_K", kv, h),
                 (f"blk.{i}.attn_v.weight", wide, kv, h),
                 (f"blk.{i}.attn_output.weight", "Q4_K", h, h),
                 (f"blk.{i}.ffn_norm.weight", "F32", 1, h),
                 (f"blk.{i}.ffn_gate.weight", "Q4_K", f, h),
                 (f"blk.{i}.ffn_up.weight", "Q4_K", f, h),
                 (f"blk.{i}.ffn_down.weight", wide, h, f)]
    return plan + [("output_norm.weight", "F32", 1, h), ("output.weight", "Q6_K", VOCAB, h)]


def copy_tokenizer(writer: Any, source: Path) -> None:
    """SmolLM2's tokenizer.* keys (vocabulary, merges, special ids, chat template)."""
    import gguf

    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)


def write_model(shape: Shape, path: Path, seed: int) -> None:
    """The random Q4_K_M GGUF of `shape`, tensor by tensor (never all in memory)."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random Llama {shape.parameters() / 1e9:.2f}B (seed {seed})")
    writer.add_block_count(shape.layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(NORM_EPS)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(FILE_TYPE_Q4_K_M)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    copy_tokenizer(writer, cache_dir() / "gguf" / SMOLLM2_GGUF_NAME)
    plan = tensor_plan(shape)
    for name, type_name, rows, cols in plan:
        if type_name == "F32":
            writer.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            block_bytes = BLOCKS[type_name][0]
            nbytes = rows * cols // SUPER_BLOCK * block_bytes
            writer.add_tensor_info(name, (rows, cols // SUPER_BLOCK * block_bytes),
                                   np.dtype(np.uint8), nbytes,
                                   gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, type_name, rows, cols in plan:
        if type_name == "F32":
            writer.write_tensor_data(np.ones(cols, np.float32))
        else:
            writer.write_tensor_data(random_blocks(rng, type_name, rows, cols))
    writer.close()


def ensure_file(name: str, shape: Shape) -> Path:
    """The model's GGUF in specpage's cache: written unless the one there
    records this shape, seed and writer."""
    folder = cache_dir() / "bench-scaling"
    path = folder / f"llama-{name}-random-q4_k_m.gguf"
    record = folder / f"{path.name}.json"
    wanted = {"shape": asdict(shape), "seed": SEED, "writer": WRITER_VERSION,
              "blocks": {name: list(block[2]) for name, block in BLOCKS.items()}}
    if path.is_file() and record.is_file() and json.loads(record.read_text()) == wanted:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)
    started = time.perf_counter()
    part = path.with_suffix(".gguf.part")
    write_model(shape, part, SEED)
    os.replace(part, path)
    record.write_text(json.dumps(wanted) + "\n")
    print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return path
