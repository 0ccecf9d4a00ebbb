"""The attention backend for a device: the Triton kernels on CUDA, the torch
reference otherwise."""

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


def select_backend(device: torch.device) -> AttentionBackend:
    """The Triton kernels on CUDA, the torch reference otherwise."""
    return BACKENDS.get(device.type, TorchAttention)()
