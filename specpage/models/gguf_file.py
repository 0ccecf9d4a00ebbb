"""A GGUF file read as a Hugging Face checkpoint, with no dense copy on disk.

    config     the metadata as a config.json-shaped dict, transformers' key
               names (its GGUF_CONFIG_MAPPING), for ModelConfig.from_dict
    tensors    every tensor under its HF name, in memory: F32/F16/BF16 as
               stored, the quantized types dequantized by gguf.quants (the
               exact values llama.cpp computes with)
    folder     the tokenizer (and chat template) transformers builds from the
               file, saved once in a small folder of the cache beside a copy
               of the config; it holds no weights

A linear's stored blocks are reachable before any dequantizing:
:meth:`GGUFFile.projection_parts` gives a fused projection's parts as raw
bytes, which is where a module computing on those blocks takes them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specpage.models.config import FREQ_FACTORS_KEY, ModelLoadError
from specpage.models.gguf_blocks import (
    GGUF_PARTS,
    PERMUTED_QK,
    Header,
    TensorInfo,
    read_gguf_header,
    rope_unpermute,
)
from specpage.models.gguf_dequant import RawTensor, dequantize

# GGUF general.architecture -> (config.json architectures[0], model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# "<architecture>.<key>" -> config.json key
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
TOKEN_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
# llama.cpp sets these for Gemma 3 in code (llama-model.cpp), not in the file
GEMMA3_SLIDING_PATTERN = 6  # every 6th layer attends globally
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_27B_LAYERS = 62  # the one size that scales queries by hidden / heads

# Per rotary pair, the divisor of its frequency (read into the config)
ROPE_FREQS = "rope_freqs.weight"
# GGUF tensor -> HF tensor (llama.cpp's gguf-py tensor_mapping, read backwards)
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
               "output": "lm_head"}
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GEMMA3_LAYER_TENSORS = {
    **LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
LAYER_NAMES = {"llama": LAYER_TENSORS, "qwen2": LAYER_TENSORS, "qwen3": LAYER_TENSORS,
               "gemma3": GEMMA3_LAYER_TENSORS}
# llama.cpp's converter stores a Gemma norm as 1 + w, the factor it multiplies
# by; HF's Gemma norm computes (1 + w) itself (transformers' Gemma2TensorProcessor)
NORMS_STORED_PLUS_ONE = ("gemma3",)

SOURCE_FILE = "specpage-source.json"  # fetch.SOURCE_FILE: what a cached folder came from


class GGUFFile:
    """One GGUF file: its header parsed (arrays left unread), its bytes mapped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            # a plain ndarray over the mapping: numpy's memmap subclass costs
            # a Python call per view, and dequantizing makes 200k of them
            self.data = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
            self.header: Header = read_gguf_header(self.data)
        except (ValueError, OSError, IndexError, KeyError) as error:
            raise ModelLoadError(f"{path}: unreadable GGUF ({error})") from None
        if self.architecture not in ARCHITECTURES:
            raise ModelLoadError(f"{path}: GGUF architecture {self.architecture!r} unsupported; "
                                 f"supported: {', '.join(ARCHITECTURES)}")

    @property
    def architecture(self) -> str:
        return self.header.architecture

    @cached_property
    def identity(self) -> bytes:
        """A digest of the header (metadata, tensor names, types, offsets)
        and the file's size: cheap, and it tells two checkpoints apart."""
        digest = hashlib.sha256(self.data[:self.header.size].tobytes())
        digest.update(str(self.data.size).encode())
        return digest.digest()

    def config(self) -> dict[str, Any]:
        config = hf_config(self.header, self.path)
        if ROPE_FREQS in self.header.tensors:
            # llama.cpp divides each rotary pair's frequency by its factor
            # (Llama 3's rope scaling, as its converter writes it)
            factors = self.dense(ROPE_FREQS).flatten().tolist()
            head_dim = config.get("head_dim") or (config["hidden_size"]
                                                  // config["num_attention_heads"])
            if len(factors) != head_dim // 2:
                raise ModelLoadError(f"{self.path}: {ROPE_FREQS} holds {len(factors)} factors; "
                                     f"a head of {head_dim} has {head_dim // 2} rotary pairs")
            config[FREQ_FACTORS_KEY] = factors
        return config

    def raw(self, name: str) -> RawTensor:
        import gguf

        info = self.raw_info(name)
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[info.type_name]]
        cols, rows = info.shape[0], math.prod(info.shape[1:])
        row_bytes = cols // block_size * type_size
        data = self.data[info.offset:info.offset + rows * row_bytes].reshape(rows, row_bytes)
        heads = self._permuted_heads(name)
        if heads:  # whole rows move, whatever the type's blocks
            data = data[rope_unpermute(rows, heads).numpy()]
        return RawTensor(name, info.type_name, tuple(reversed(info.shape)), data)

    def projection_parts(self, layer: int, projection: str) -> list[RawTensor]:
        """The stored parts of our fused ``projection`` (models/gguf_blocks
        GGUF_PARTS: qkv_proj, o_proj, gate_up_proj, down_proj) in layer
        ``layer``, in the order they are concatenated along the rows: what a
        linear computing on GGUF blocks (K-quants included) takes instead of
        the dense weight."""
        return [self.raw(f"blk.{layer}.{part}.weight") for part in GGUF_PARTS[projection]]

    def dense(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as HF holds it: float types as stored, quantized
        ones dequantized to fp32."""
        tensor = dequantize(self.raw(name), self.path)
        if self.architecture in NORMS_STORED_PLUS_ONE and name.endswith("norm.weight"):
            tensor -= 1
        return tensor

    def linear_names(self) -> list[str]:
        """The GGUF names of every layer's linear weights."""
        layers = int(self.header.metadata[f"{self.architecture}.block_count"])  # type: ignore[call-overload]
        return [f"blk.{i}.{part}.weight" for i in range(layers)
                for parts in GGUF_PARTS.values() for part in parts]

    def linear_types(self) -> set[str]:
        return {self.raw_info(name).type_name for name in self.linear_names()}

    def raw_info(self, name: str) -> TensorInfo:
        try:
            return self.header.tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: GGUF lacks tensor {name!r}") from None

    def tensors(self, dense_linears: bool = True,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Every tensor, dense, by its HF name. dense_linears False: the
        layers' linear weights are placeholders of their shape instead (one
        zero of dtype, the model's, expanded: no memory, and no copy when
        the model takes its dtype), for a caller that swaps those linears
        for modules on the stored blocks."""
        placeholders = set() if dense_linears else set(self.linear_names())
        return {self.hf_name(name): (torch.zeros((), dtype=dtype).expand(
                                         self.raw_info(name).shape[::-1])
                                     if name in placeholders else self.dense(name))
                for name in self.header.tensors if name != ROPE_FREQS}  # in the config

    def hf_name(self, name: str) -> str:
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 4:
            hf = LAYER_NAMES[self.architecture].get(parts[2])
            if hf is not None:
                return f"model.layers.{parts[1]}.{hf}.{parts[3]}"
        elif len(parts) == 2 and parts[0] in TOP_TENSORS:
            return f"{TOP_TENSORS[parts[0]]}.{parts[1]}"
        raise ModelLoadError(f"{self.path}: GGUF tensor {name!r} has no Hugging Face "
                             f"counterpart in a {self.architecture} model")

    def _permuted_heads(self, name: str) -> int:
        """The heads whose q/k rows llama.cpp permuted in ``name``; 0: none."""
        if self.architecture not in PERMUTED_QK:
            return 0
        part = name.split(".")[2] if name.startswith("blk.") else ""
        meta, arch = self.header.metadata, self.architecture
        count = {"attn_q": f"{arch}.attention.head_count",
                 "attn_k": f"{arch}.attention.head_count_kv"}
        if part not in count:
            return 0
        return int(meta.get(count[part]) or meta[count["attn_q"]])  # type: ignore[call-overload]


def hf_config(header: Header, path: Path) -> dict[str, Any]:
    """The config.json an HF checkpoint of this file would have."""
    meta, arch = header.metadata, header.architecture
    architecture, model_type = ARCHITECTURES[arch]
    config: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    for key, name in CONFIG_KEYS.items():
        if f"{arch}.{key}" in meta:
            config[name] = meta[f"{arch}.{key}"]
    for key, name in TOKEN_IDS.items():
        if key in meta:
            config[name] = meta[key]
    tokens = meta.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and tokens is not None:
        config["vocab_size"] = tokens.count  # type: ignore[attr-defined]
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is None and arch in PERMUTED_QK:  # rope spans the whole head there
        head_dim = meta.get(f"{arch}.rope.dimension_count")
    if head_dim is not None:
        config["head_dim"] = head_dim
    config["tie_word_embeddings"] = "output.weight" not in header.tensors
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling,
                                  "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0)}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = original
    if arch == "gemma3":
        config.update(gemma3_config(header, config))
    missing = [name for name in CONFIG_KEYS.values() if name not in config]
    if missing:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    return config


def gemma3_config(header: Header, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's keys beyond the common ones, as llama.cpp runs the file."""
    meta, layers = header.metadata, config["num_hidden_layers"]
    pattern = int(meta.get("gemma3.attention.sliding_window_pattern")  # type: ignore[call-overload]
                  or GEMMA3_SLIDING_PATTERN)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": meta.get("gemma3.attention.sliding_window"),
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                        for i in range(layers)],
        "query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"]
                                  if layers == GEMMA3_27B_LAYERS else head_dim),
        "rope_local_base_freq": meta.get("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA),
        "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": meta.get("gemma3.attn_logit_softcapping"),
    }


def is_gguf_folder(folder: Path) -> bool:
    """Whether ``folder`` is the tokenizer folder of a GGUF (metadata_folder)."""
    return (folder / SOURCE_FILE).is_file() and "gguf_path" in _source(folder)


def gguf_of(path: Path) -> Path | None:
    """The GGUF a path loads from: the file itself, or the one a GGUF's
    tokenizer folder was made from; None for anything else."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or not is_gguf_folder(path):
        return None
    gguf_path = Path(_source(path)["gguf_path"])
    if not gguf_path.is_file():
        raise ModelLoadError(f"{path}: made from {gguf_path}, which is gone")
    return gguf_path


def _source(folder: Path) -> dict[str, Any]:
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return source if isinstance(source, dict) else {}


def metadata_folder(file: GGUFFile, cache: Path) -> Path:
    """``<cache>/gguf-metadata/<key>``: the file's tokenizer files as
    transformers builds them from it (chat template included), its config,
    and where the file is; written once, atomically."""
    path = file.path.resolve()
    # Keyed by the path too: two files with one header (the same model
    # quantized alike) differ in weights, and the folder points at one file.
    key = hashlib.sha256(file.identity + str(path).encode()).hexdigest()[:24]
    folder = cache / "gguf-metadata" / key
    if (folder / SOURCE_FILE).is_file():
        return folder
    # Imported here: transformers is slow to import, and a cached folder needs none of it.
    from transformers import AutoTokenizer

    config = file.config()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # The GGUF carries no length limit for the tokenizer; the model's context is the honest one.
    tokenizer.model_max_length = config["max_position_embeddings"]
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # written last: its presence marks the folder finished
        (tmp / SOURCE_FILE).write_text(json.dumps(
            {"gguf_file": path.name, "gguf_path": str(path)}, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache holds public files
        for item in tmp.iterdir():
            item.chmod(0o644)
        if folder.exists() and not (folder / SOURCE_FILE).is_file():
            shutil.rmtree(folder)  # left unfinished by a crash
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / SOURCE_FILE).is_file():
                raise
            shutil.rmtree(tmp)  # another process finished the same folder first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
