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


def select_backend(device: torch.device, head_dim: int | None = None) -> AttentionBackend:
    """The Triton kernels on CUDA, the torch reference otherwise; on CPU, given
    the model's head_dim, the native kernel where it was built for it."""
    if device.type == "cpu" and head_dim is not None:
        from specpage.attention.cpu import CpuAttention, cpu_backend_fits

        if cpu_backend_fits(head_dim):
            return CpuAttention()
    return BACKENDS.get(device.type, TorchAttention)()
