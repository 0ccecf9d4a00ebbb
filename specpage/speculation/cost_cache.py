"""Forward costs measured at start-up, kept on disk for the next start.

A daemon restarted on the same machine with the same models times the same
forwards again; the cache skips that. The key names everything the timings
depend on: both models (their identity digests), the machine (CPU model, the
instruction sets kernels dispatch on, torch's version and threads, the GPU),
the dtype and block size, what was timed (sizes, rows, context), and
specpage's own code (its Python and kernel sources: a faster forward makes
the old timings wrong, and the policy would price proposals by them). Only a
measurement that timed every size is stored; timings from a busy moment are
corrected online by the policy either way.

Files live under the specpage cache directory (`models.fetch.cache_dir`):
``<cache>/costs/<key>.json``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from dataclasses import asdict
from pathlib import Path

import msgspec
import torch

from specpage.core.paths import cache_dir
from specpage.speculation.calibrate import Plan

VERSION = 2  # of the key and the file's content; bump when either changes meaning
# CPU flags kernels dispatch on (oneDNN, BLAS, torch's vectorised ops).
KERNEL_FLAGS = frozenset({
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
    "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "sve2", "bf16", "i8mm",
})


class CachedCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """(positions, least seconds) per timed size, for each model."""

    target: list[tuple[int, float]]
    draft: list[tuple[int, float]]


def machine() -> dict[str, object]:
    """What forward timings depend on besides the models and the plan."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name == "model name":
                model = value.strip()
            elif name in ("flags", "Features"):
                flags |= set(value.split())
    except OSError:  # not Linux: the processor string and torch's view below
        pass
    return {
        "cpu": model,
        "flags": sorted(flags & KERNEL_FLAGS),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


@functools.cache
def code_digest() -> str:
    """A digest of specpage's sources (.py, and the native kernels' .cpp, .h)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_path(identities: tuple[bytes, bytes], plan: Plan, dtype: torch.dtype,
               block_size: int, graphs: bool = False) -> Path:
    """graphs: whether forwards replay from CUDA graphs (engine.cuda_graphs),
    which take a GPU's short forwards from bound by launches to a few ms."""
    key = {
        "version": VERSION,
        "models": [identity.hex() for identity in identities],
        "machine": machine(),
        "code": code_digest(),
        "dtype": str(dtype),
        "block_size": block_size,
        "plan": asdict(plan),
        **({"graphs": True} if graphs else {}),  # the keys measured before stay
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / "costs" / f"{digest[:32]}.json"


def load(path: Path) -> CachedCosts | None:
    """The stored costs, or None when missing or unreadable (then measure)."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=CachedCosts)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def store(path: Path, costs: CachedCosts) -> None:
    """Write atomically, so that a daemon starting at the same time reads
    the whole file or none."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            f.write(msgspec.json.encode(costs))
        os.replace(f.name, path)
    except OSError:  # a read-only cache costs the next start a measurement, nothing else
        pass
