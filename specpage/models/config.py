"""What the runtime needs to know of a decoder-only checkpoint, read from its
HF ``config.json`` (both the older ``rope_theta``/``rope_scaling`` keys and
the newer ``rope_parameters`` form)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpage.layers.rope_config import RopeConfig

# architecture name in config.json -> family; Mistral and SmolLM are Llamas.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(Exception):
    """A checkpoint that cannot be loaded; the message names the file or field."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "heads must be a multiple of KV heads"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else raw.get("model_type", "?")
        family = ARCHITECTURES.get(architecture)
        if family is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {architecture!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: unsupported hidden_act {raw['hidden_act']!r}")
        try:
            heads = raw["num_attention_heads"]
            max_position = raw.get("max_position_embeddings", 2048)
            # A sliding window narrower than the context is not implemented:
            # serve only contexts that fit inside it, where it changes nothing.
            window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
            if window:
                max_position = min(max_position, window)
            eos = raw.get("eos_token_id")
            return cls(
                architecture=architecture,
                family=family,
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_layers=raw["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope=_rope(raw, source),
                max_position=max_position,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
                o_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            )
        except KeyError as error:
            raise ModelLoadError(f"{source}: missing field {error.args[0]!r}") from None

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = folder / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: no config.json (is this an HF model folder?)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ModelLoadError(f"{path}: not valid JSON ({error})") from None
        return cls.from_dict(raw, str(path))


def _rope(raw: dict[str, Any], source: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


# An EAGLE-3 draft head's config (models/eagle3.py) names this architecture.
ARCHITECTURE = "LlamaForCausalLMEagle3"


def is_head_folder(folder: Path) -> bool:
    """Whether an HF folder holds an EAGLE-3 head (its config's architectures)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and ARCHITECTURE in (raw.get("architectures") or [])
