"""What this machine's CPU offers, read once from /proc/cpuinfo: the choice
of dtype and of the way each product runs depends on it (bf16 products are
fast with AVX-512 BF16 or AMX and far slower without: docs/BENCHMARKS.md,
"CPU products")."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first processor's feature flags; empty where /proc/cpuinfo is unreadable."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_fast_bf16() -> bool:
    """bf16 matmuls run natively (AVX-512 BF16 or AMX)."""
    return bool(cpu_flags() & BF16_FLAGS)


def has_amx() -> bool:
    """bf16 matmuls of many rows run on AMX tiles (oneDNN takes them there)."""
    return "amx_bf16" in cpu_flags()


def has_avx512() -> bool:
    return "avx512f" in cpu_flags()


def describe() -> str:
    """A key naming this CPU's instruction set, for builds made with -march=native."""
    return " ".join(sorted(cpu_flags())) or platform.processor() or platform.machine()
