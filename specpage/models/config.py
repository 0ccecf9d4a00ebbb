"""What the runtime needs to know of a decoder-only checkpoint, read from its
HF ``config.json`` (both the older ``rope_theta``/``rope_scaling`` keys and
the newer ``rope_parameters`` form, per layer type for Gemma 3)."""

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
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
ROPE_TYPES = ("default", "linear", "llama3")
# The families whose layers attend within their own window (layer_types);
# the others serve only contexts that fit inside a window they declare.
WINDOWED_FAMILIES = ("qwen3", "gemma3")
# The MLP activation each family's checkpoints name, and the key naming it.
ACTIVATIONS = {"gemma3": ("hidden_activation", "gelu_pytorch_tanh")}
DEFAULT_ACTIVATION = ("hidden_act", "silu")
FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types
# Gemma 3's global and local rotary bases where its config names none
# (transformers' Gemma3TextConfig.default_theta).
GEMMA3_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
GEMMA3_GLOBAL_EVERY = 6  # an older Gemma 3 config's sliding_window_pattern, if absent
# What transformers' config classes assume where config.json leaves a key
# out (Gemma3TextConfig, Qwen3Config), where it is not the other families'.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "max_position_embeddings": 131072, "tie_word_embeddings": True},
    "qwen3": {"head_dim": 128},
}


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
    hidden_act: str = "silu"  # "gelu_pytorch_tanh" for Gemma 3's GeGLU
    qk_norm: bool = False  # an RMSNorm over head_dim on q and k before rotary (Qwen3, Gemma 3)
    # Keys a sliding layer sees: the query's position and the window - 1
    # before it. None: every layer attends to its whole context.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer, FULL or SLIDING; () all FULL
    local_rope: RopeConfig | None = None  # sliding layers' rotary, where it is not `rope`
    query_pre_attn_scalar: float | None = None  # attention scale its ** -0.5; None: head_dim's

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "heads must be a multiple of KV heads"
        assert not self.layer_types or len(self.layer_types) == self.num_layers
        assert set(self.layer_types) <= {FULL, SLIDING}

    def is_sliding(self, layer: int) -> bool:
        """Whether layer_types names the layer sliding (its window may be None)."""
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    def window_of(self, layer: int) -> int | None:
        """The window a layer attends within, None for its whole context."""
        return self.sliding_window if self.is_sliding(layer) else None

    def rope_of(self, layer: int) -> RopeConfig:
        """The rotary settings of a layer: sliding layers may have their own."""
        if self.local_rope is not None and self.is_sliding(layer):
            return self.local_rope
        return self.rope

    @property
    def attention_scale(self) -> float:
        scalar = self.query_pre_attn_scalar or self.head_dim
        return float(scalar) ** -0.5

    @property
    def windowed(self) -> bool:
        return any(self.window_of(i) is not None for i in range(self.num_layers))

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
        raw = {**FAMILY_DEFAULTS.get(family, {}), **raw}
        key, activation = ACTIVATIONS.get(family, DEFAULT_ACTIVATION)
        if (raw.get(key) or activation) != activation:
            raise ModelLoadError(f"{source}: unsupported {key} {raw[key]!r} for {architecture}; "
                                 f"supported: {activation}")
        _refuse_unsupported(raw, source)
        try:
            heads = raw["num_attention_heads"]
            max_position = raw.get("max_position_embeddings", 2048)
            window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
            layer_types: tuple[str, ...] = ()
            if family in WINDOWED_FAMILIES:
                layer_types = _layer_types(raw, family, window, source)
            elif window:
                # A window narrower than the context is implemented for
                # WINDOWED_FAMILIES only: serve only contexts that fit inside
                # it, where it changes nothing.
                max_position = min(max_position, window)
            global_rope, local_rope = _ropes(raw, family, source)
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
                rope=global_rope,
                max_position=max_position,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
                o_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                hidden_act=activation,
                qk_norm=family in ("qwen3", "gemma3"),
                sliding_window=int(window) if window and layer_types else None,
                layer_types=layer_types,
                local_rope=local_rope,
                query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if family == "gemma3"
                else None,
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


def _refuse_unsupported(raw: dict[str, Any], source: str) -> None:
    """Gemma's options that change attention or the logits in ways not built."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise ModelLoadError(f"{source}: {key} {raw[key]!r} is not supported (only null)")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention is not supported")


def _layer_types(raw: dict[str, Any], family: str, window: int | None, source: str
                 ) -> tuple[str, ...]:
    """Each layer's attention, FULL or SLIDING, as transformers' config
    derives it where config.json does not list it."""
    layers = raw["num_hidden_layers"]
    listed = raw.get("layer_types")
    if listed is not None:
        if len(listed) != layers or not set(listed) <= {FULL, SLIDING}:
            raise ModelLoadError(f"{source}: layer_types must name {FULL} or {SLIDING} for "
                                 f"each of the {layers} layers")
        return tuple(listed)
    if family == "gemma3":  # every n-th layer global
        every = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or (
            GEMMA3_GLOBAL_EVERY)
        return tuple(SLIDING if (i + 1) % every else FULL for i in range(layers))
    first = raw.get("max_window_layers", layers)  # Qwen: the layers from this one slide
    return tuple(SLIDING if window and i >= first else FULL for i in range(layers))


def _ropes(raw: dict[str, Any], family: str, source: str) -> tuple[RopeConfig, RopeConfig | None]:
    """The rotary settings of full-attention layers, and of sliding ones
    where they differ (Gemma 3's local base)."""
    if family != "gemma3":
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        return _rope(params, raw.get("rope_theta", 10000.0), source,
                     raw.get(FREQ_FACTORS_KEY)), None
    by_type = raw.get("rope_parameters") or {}
    if FULL in by_type or SLIDING in by_type:
        full, sliding = by_type.get(FULL) or {}, by_type.get(SLIDING) or {}
    else:  # the older keys: rope_scaling applies to the global layers only
        full, sliding = raw.get("rope_scaling") or {}, {}
    return (_rope(full, raw.get("rope_theta", GEMMA3_THETA[FULL]), source),
            _rope(sliding, raw.get("rope_local_base_freq", GEMMA3_THETA[SLIDING]), source))


# A config.json key of specpage's own: per rotary pair, a divisor of its
# inverse frequency (RopeConfig.freq_factors), which models/gguf_file.py
# writes from a GGUF's rope_freqs tensor.
FREQ_FACTORS_KEY = "rope_freq_factors"


def _rope(params: dict[str, Any], default_theta: float, source: str,
          freq_factors: list[float] | None = None) -> RopeConfig:
    theta = params.get("rope_theta", default_theta)
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
        freq_factors=tuple(float(f) for f in freq_factors or ()),
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
