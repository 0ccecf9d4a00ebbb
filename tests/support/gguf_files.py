"""Tiny HF checkpoints written as GGUF files, laid out as llama.cpp's
converter lays them out (its tensor names, Llama's q/k rows permuted,
Gemma's norms stored as 1 + w), with a byte-level BPE tokenizer."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

F32 = gguf.GGMLQuantizationType.F32
ARCHITECTURE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GEMMA3_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}")


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: the base vocabulary of a byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in sorted(chars, key=lambda b: (b not in printable, b))]


TOKENS = [*SPECIAL, *byte_level_alphabet(), "he"]
VOCAB_SIZE = len(TOKENS)  # what a tiny checkpoint written here must have


def gguf_name(hf: str, architecture: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base in TOP:
        return f"{TOP[base]}.{kind}"
    _, _, layer, part = base.split(".", 3)
    names = GEMMA3_LAYER if architecture == "gemma3" else LAYER
    return f"blk.{layer}.{names[part]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of a Llama's q/k rows."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(model: torch.nn.Module, path: Path,
               type_of: Callable[[str], gguf.GGMLQuantizationType] = lambda name: F32,
               ) -> dict[str, torch.Tensor]:
    """Write HF ``model`` (eval, fp32) as a GGUF at ``path``, each 2-D
    weight in type_of(HF name); returns the HF state the file holds exactly
    (a quantized weight's dequantized values)."""
    config = model.config
    architecture = ARCHITECTURE[config.architectures[0]]
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny test model")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"] if "rope_theta" in
                         config.rope_parameters else
                         config.rope_parameters["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if architecture == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if architecture == "gemma3":
        w.add_sliding_window(config.sliding_window)
    _add_tokenizer(w)
    if config.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(config.rope_parameters, head_dim))
    held = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        stored = gguf_name(name, architecture)
        qtype = type_of(name) if values.ndim == 2 else F32
        raw = None
        if qtype.name in K_SCALES:  # gguf cannot quantize to these: random blocks
            assert architecture != "llama", "K-quant blocks are written unpermuted"
            raw = random_kquant(*values.shape, qtype, len(held))
            values = gguf.quants.dequantize(raw, qtype)
        elif qtype != F32:
            values = gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype)
        held[name] = torch.from_numpy(values.copy())
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
        part = stored.split(".")[2] if stored.startswith("blk.") else ""
        if architecture == "llama" and part in heads:
            values = permute(values, heads[part])
        if architecture == "gemma3" and name.endswith("norm.weight"):
            values = values + np.float32(1)
            held[name] = torch.from_numpy(values - np.float32(1))  # what reading it back gives
        if qtype == F32:
            w.add_tensor(stored, np.ascontiguousarray(values))
        elif raw is not None:
            w.add_tensor(stored, raw, raw_dtype=qtype)
        else:
            w.add_tensor(stored, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter (convert_hf_to_gguf.py,
    LlamaModel) writes for Llama 3's rope scaling: per rotary pair, the
    divisor of its frequency."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# K-quant type -> (bytes per super-block of 256, where its fp16 scales lie, their value)
K_SCALES = {"Q4_K": (144, (0, 2), (2e-4, 1e-4)), "Q5_K": (176, (0, 2), (1e-4, 1e-4)),
            "Q6_K": (210, (208,), (2e-5,))}


def random_kquant(rows: int, cols: int, qtype: gguf.GGMLQuantizationType,
                  seed: int) -> np.ndarray:
    """[rows, bytes per row] uint8: super-blocks of random levels and
    sub-block scales, their fp16 scales set so the weights stay small."""
    size, offsets, scales = K_SCALES[qtype.name]
    blocks = np.random.default_rng(seed).integers(0, 256, (rows, cols // 256, size),
                                                   dtype=np.uint8)
    for offset, scale in zip(offsets, scales, strict=True):
        blocks[..., offset:offset + 2] = np.array([scale], np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _add_tokenizer(w: gguf.GGUFWriter) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(TOKENS) - len(SPECIAL)))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
