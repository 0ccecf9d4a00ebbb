"""The native CPU kernels (the C++ sources in specpage/kernels/cpu/, one
extension registering torch.ops.specpage_cpu): built once per machine with
torch's cpp_extension into the specpage cache, loaded from there afterwards.

- paged_attention.cpp: attention over KV blocks read in place
  (specpage/attention/cpu.py; its reference is in specpage/attention/native.py);
- fused_ops.cpp: RMSNorm (with the residual add), SiLU- and GELU-and-mul
  and rotary embeddings (after q/k norms, where a model has them), one pass
  each (specpage/layers/fused.py, which holds their references);
- bf16_gemv.cpp and bf16_panels.cpp: bf16 products of up to 8 and of 9 to
  64 rows on AVX-512 BF16 (specpage/layers/products.py cpu_linear; where the
  build lacks the instructions, has_bf16_gemv() is false and oneDNN takes
  them);
- int4_gemv.cpp: group-wise int4 products of a few rows on AVX-512 BF16
  (specpage/layers/quant.py; torch's int4 kernel elsewhere), and, where the
  CPU has AVX-512 VNNI, int4 and Q8_0 products of any number of rows with
  x taken to int8 per group of 32 (int8x_gemv);
- kquant_gemv.cpp: products of GGML's K-quant blocks (Q4_K, Q5_K, Q6_K)
  as a GGUF stores them, x taken to int8 per 256 values (vpdpbusd where
  the CPU has AVX-512 VNNI, a portable loop elsewhere), and their
  dequantization to bf16 (specpage/layers/kquant.py, which holds the
  reference);
- sampling.cpp: a token's probability at a temperature, draws from the
  logits with a proposed token taken out, and the one-hot acceptance of a
  step's proposals with its draw in one call
  (specpage/speculation/verifier.py; sampler.py is the reference);
- decoder_stack.cpp: a decoder's layers in one call, the ops above called
  from C++ in the order DecoderLayer.forward calls them
  (specpage/layers/native_stack.py).

The build is optional: without a compiler, ninja or a CPU build of torch it
fails, the failure is logged once, and every caller takes its pure-torch way
(`native_kernels()` returns None).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specpage.kernels.cpu import features as cpu

log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).resolve().parent.glob("*.cpp"))  # beside this file
HEADERS = sorted(Path(__file__).resolve().parent.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fopenmp-simd", "-std=c++17"]
DISABLE_ENV = "SPECPAGE_NATIVE_KERNELS"  # "0": never build or load them

_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def build_key() -> str:
    """Names one build: the sources and headers, where they are, flags, torch
    and the CPU's instruction set (the build is -march=native, so a cache
    shared by machines of different CPUs keeps their builds apart; and
    torch rebuilds a folder whose sources moved, so two checkouts sharing
    a cache would otherwise rebuild it in turn)."""
    digest = hashlib.sha256()
    for part in (*(path.read_bytes() for path in SOURCES + HEADERS), " ".join(FLAGS).encode(),
                 str(SOURCES[0].parent if SOURCES else "").encode(),
                 torch.__version__.encode(), cpu.describe().encode()):
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


@functools.cache
def loaded_kernels() -> Any:
    """native_kernels() looked up once per process, for calls on a step's hot
    path: native_kernels() reads the environment and takes a lock, a few
    microseconds that each of a step's hundreds of calls would pay."""
    return native_kernels()


@contextlib.contextmanager
def _builder(folder: Path) -> Iterator[None]:
    """One process at a time builds or loads a folder's kernels. torch marks
    a build with a `lock` file and waits for it to go, forever: a process
    killed while building (a daemon stopped during its start) leaves it
    behind, and every later start would hang. An advisory lock, which the
    kernel drops when its holder dies, keeps builders apart instead; any
    `lock` file found while holding it belongs to a builder that died."""
    with open(folder.with_suffix(".flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _build() -> Any:
    from torch.utils import cpp_extension

    from specpage.core.paths import cache_dir

    key = build_key()
    folder = cache_dir() / "kernels" / f"cpu-{key}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _builder(folder):
            if not any(folder.glob("*.so")):
                log.info("building the native CPU kernels into %s (once, ~30 s)", folder)
            cpp_extension.load(
                name=f"specpage_cpu_{key}", sources=[str(source) for source in SOURCES],
                extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(folder),
                is_python_module=False, verbose=False,
            )
        return torch.ops.specpage_cpu
    except Exception as error:  # noqa: BLE001 (any build failure means: use the fallback)
        log.warning("native CPU kernels unavailable, using torch ops instead: %s",
                    str(error).strip().splitlines()[-1] if str(error).strip() else error)
        return None
