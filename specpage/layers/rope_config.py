"""A rotary embedding's settings, as a checkpoint's config names them
(specpage.models.config reads them): torch-free, so the config can hold
them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # per rotary pair: a divisor of its inverse frequency, after the type's
    # own scaling (llama.cpp's rope_freqs tensor: how a GGUF of Llama 3.1 or
    # later stores Llama 3's scaling); () divides nothing
    freq_factors: tuple[float, ...] = ()
