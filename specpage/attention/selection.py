"""The attention backend for a device: the Triton kernels on CUDA, the native
CPU kernel for short spans where it builds, the torch reference otherwise."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specpage.attention.backend import AttentionBackend
from specpage.attention.reference import TorchAttention


def _triton() -> AttentionBackend:
    # Imported on demand: triton is only needed where the tensors are on CUDA.
    from specpage.attention.triton import TritonAttention

    return TritonAttention()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"cpu": TorchAttention, "cuda": _triton}


class NoInvariantAttention(ValueError):
    """Row-invariant attention (engine.deterministic) asked of a device or
    head_dim that has no kernel for it."""


def select_backend(device: torch.device, head_dim: int | None = None,
                   row_invariant: bool = False) -> AttentionBackend:
    """The Triton kernels on CUDA, the torch reference otherwise; on CPU, given
    the model's head_dim, the native kernel where it was built for it.
    row_invariant: every span through the native CPU kernel (attention/cpu.py
    CpuAttention), or NoInvariantAttention where it cannot be."""
    if device.type == "cpu" and head_dim is not None:
        from specpage.attention.cpu import CpuAttention, cpu_backend_fits

        if cpu_backend_fits(head_dim):
            return CpuAttention(every_span=row_invariant)
    if row_invariant:
        from specpage.attention.native import NATIVE_HEAD_DIMS

        raise NoInvariantAttention(
            f"engine.deterministic needs the native CPU attention kernel, which this "
            f"{device.type} device with head_dim {head_dim} does not have (it is built for CPUs, "
            f"head_dim in {NATIVE_HEAD_DIMS}, with a C++ compiler; SPECPAGE_NATIVE_KERNELS=0 "
            "turns it off)")
    return BACKENDS.get(device.type, TorchAttention)()
