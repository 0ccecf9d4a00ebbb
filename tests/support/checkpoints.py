"""Tiny random checkpoints made with transformers, for exactness tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specpage.core.block_pool import BlockPool
from specpage.core.engine_config import EngineConfig
from specpage.core.request import SamplingParams
from specpage.core.span import Span
from specpage.llm import LLM
from specpage.models.fetch import ensure_model
from specpage.models.loader import draft_dtype, load_model

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny_checkpoint(
    folder: Path, family: str = "llama", seed: int = 0, shard: bool = False, **overrides
):
    """Save a random tiny model; returns the HF model (eval, fp32)."""
    config_cls, model_cls = FAMILIES[family]
    options = dict(
        vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
    )
    options.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**options)).eval()
    # Random init leaves biases at zero; give them values so they are tested.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(folder, **({"max_shard_size": "60KB"} if shard else {}))
    return model


NORMED_FAMILIES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM),
                   "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}


def family_checkpoint(folder: Path, family: str, seed: int = 0, **overrides):
    """A random tiny Qwen3 or Gemma 3 saved with save_pretrained; returns
    the HF model (eval, fp32). 7 layers: Gemma 3's 6th global, the others
    sliding (given a sliding_window); Gemma 3 with a scale other than
    head_dim's and a global rotary unlike the local one."""
    config_cls, model_cls = NORMED_FAMILIES[family]
    options = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   max_position_embeddings=256, rms_norm_eps=1e-6)
    if family == "gemma3":
        options.update(query_pre_attn_scalar=24, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    else:
        options.update(tie_word_embeddings=False)
    options.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**options)).eval()
    with torch.no_grad():  # norms start at 1 (Gemma: 0); give them values so they are tested
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(folder)
    return model


SMOLLM2_VOCAB = 49152  # the vocabulary of SmolLM2's tokenizer


def target_and_draft(root: Path):
    """A tiny target (with its transformers model) and a one-layer draft,
    written under root and loaded: (hf, target, draft)."""
    hf = tiny_checkpoint(root / "target")
    tiny_checkpoint(root / "draft", seed=1, num_hidden_layers=1)
    return hf, load_model(root / "target"), load_model(root / "draft")


def tokenizer_pair(folder: Path) -> None:
    """Tiny target and draft with SmolLM2's tokenizer and chat template, where
    Daemon looks for its models (it keeps a pair it finds)."""
    smollm2 = ensure_model("smollm2-135m")
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        tiny_checkpoint(folder / name, seed=seed, num_hidden_layers=layers,
                        vocab_size=SMOLLM2_VOCAB)
        for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(smollm2 / file, folder / name / file)


def greedy_through_pool(runner, prompts, max_new, chunk, block_size):
    """Continuous-batching-style greedy decode: chunked prefill, then one
    token per sequence per forward, all through one BlockPool."""
    pool = BlockPool(runner.kv.tensor.shape[2], block_size)  # the runner's blocks
    outputs = {i: [] for i in range(len(prompts))}
    pending = {}  # seq -> next token to feed (its KV is not written yet)
    for i, prompt in enumerate(prompts):
        pool.allocate_prompt(i, prompt)
    prefill_pos = dict.fromkeys(range(len(prompts)), 0)
    while len(pending) < len(prompts):
        spans, owners = [], []
        for i, prompt in enumerate(prompts):
            start = prefill_pos[i]
            if start < len(prompt):
                piece = prompt[start : start + chunk]
                last = start + len(piece) == len(prompt)
                spans.append(Span(piece, start, list(pool.block_table(i)), int(last)))
                owners.append((i, piece, last))
        logits = runner.forward(spans)
        row = 0
        for i, piece, last in owners:
            pool.commit(i, piece)
            prefill_pos[i] += len(piece)
            if last:
                pending[i] = int(logits[row].argmax())
                outputs[i].append(pending[i])
                row += 1
    for _ in range(max_new - 1):
        spans = []
        for i in range(len(prompts)):
            pool.reserve(i, 1)
            spans.append(Span([pending[i]], pool.num_committed(i), list(pool.block_table(i)), 1))
        next_tokens = runner.forward(spans).argmax(-1).tolist()
        for i, token in enumerate(next_tokens):
            pool.commit(i, [pending[i]])
            pending[i] = token
            outputs[i].append(token)
    pool.check_integrity()
    return [outputs[i] for i in range(len(prompts))]


def models_by_dtype(root: Path, drafts: tuple[str, ...] = ("draft", "head")):
    """A getter of root/target and each root/<draft> loaded in a dtype
    ("fp32", "bf16" or "q4"), each dtype loaded once: dtype -> (target,
    {draft: model})."""
    cache: dict = {}

    def get(dtype: str):
        if dtype not in cache:
            chosen = {"fp32": None, "bf16": "bf16", "q4": None}[dtype]
            quantization = "q4" if dtype == "q4" else None
            target = load_model(root / "target", chosen, quantization=quantization)
            cache[dtype] = (target, {name: load_model(root / name, draft_dtype(chosen, target),
                                                      quantization=quantization)
                                     for name in drafts})
        return cache[dtype]

    return get


SELF_DRAFTED_PROMPTS = [[40, 41, 42, 43, 44], [50, 60, 70], [100, 101, 102, 103, 104, 105, 106]]


def self_drafted(path: Path, quantization: str, max_tokens: int):
    """(the target alone, the target drafting for itself with k 3): two LLMs
    on one checkpoint, and their greedy tokens on SELF_DRAFTED_PROMPTS."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plain = LLM(path, None, EngineConfig(spec_k=0, adaptive_k=False, num_blocks=64),
                quantization=quantization)
    spec = LLM(path, path, EngineConfig(spec_k=3, adaptive_k=False, num_blocks=64),
               quantization=quantization)
    tokens = [[c.token_ids for c in llm.generate(SELF_DRAFTED_PROMPTS, params)]
              for llm in (plain, spec)]
    return plain, spec, tokens
