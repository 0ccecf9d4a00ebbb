"""The native CPU paged-attention kernel (specpage/kernels/cpu/paged_attention.cpp):
built once per machine with torch's cpp_extension into the specpage cache,
loaded from there afterwards, and its pure-torch reference.

The build is optional: without a compiler, ninja or a CPU build of torch it
fails, the failure is logged once, and the CPU backend gathers blocks as the
reference does (`native_kernels()` returns None).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from specpage.models import cpu

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "cpu" / "paged_attention.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fopenmp-simd", "-std=c++17"]
DISABLE_ENV = "SPECPAGE_NATIVE_KERNELS"  # "0": never build or load them
NATIVE_HEAD_DIMS = (32, 64, 80, 96, 128)  # the head sizes the kernel is instantiated for

_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def build_key() -> str:
    """Names one build: the source, flags, torch and the CPU's instruction set
    (the build is -march=native, so a cache shared by machines of different
    CPUs keeps their builds apart)."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), torch.__version__.encode(),
                 cpu.describe().encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def native_kernels() -> Any:
    """The built extension, or None where it cannot be built (reason logged once)."""
    if os.environ.get(DISABLE_ENV) == "0":
        return None
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _build()
        return _loaded["module"]


def _build() -> Any:
    from torch.utils import cpp_extension

    from specpage.models.fetch import cache_dir

    key = build_key()
    folder = cache_dir() / "kernels" / f"paged_attention-{key}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not any(folder.glob("*.so")):
            log.info("building the native CPU attention kernel into %s (once, ~30 s)", folder)
        cpp_extension.load(
            name=f"specpage_paged_attention_{key}", sources=[str(SOURCE)],
            extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(folder),
            is_python_module=False, verbose=False,
        )
        return torch.ops.specpage_cpu
    except Exception as error:  # noqa: BLE001 (any build failure means: use the fallback)
        log.warning("native CPU attention kernel unavailable, gathering blocks instead: %s",
                    str(error).strip().splitlines()[-1] if str(error).strip() else error)
        return None


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    query_start: torch.Tensor,  # [num_seqs + 1] int64
    context_lens: torch.Tensor,  # [num_seqs] int64, KV after this forward's writes
    scale: float,
) -> torch.Tensor:
    """What the kernel computes, one sequence at a time in fp32: each span's
    token at row t sees positions 0 .. context - span + t. [num_tokens, heads * head_dim]."""
    heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = cache.shape[2], cache.shape[3]
    out = q.new_empty(q.shape[0], heads * head_dim)
    for s in range(context_lens.shape[0]):
        first, end, context = int(query_start[s]), int(query_start[s + 1]), int(context_lens[s])
        positions = torch.arange(context)
        blocks = block_tables[s, positions // block_size]
        k = cache[0, blocks, positions % block_size].float()  # [context, kv_heads, d]
        v = cache[1, blocks, positions % block_size].float()
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for t in (k, v))
        qs = q[first:end].float().transpose(0, 1)  # [heads, span, d]
        span = end - first
        visible = positions[None, :] <= (context - span + torch.arange(span))[:, None]
        scores = (qs @ k.transpose(1, 2)) * scale
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[first:end] = (weights @ v).transpose(0, 1).reshape(span, -1).to(q.dtype)
    return out
