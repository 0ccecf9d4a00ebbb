"""Large CPU tensors on transparent huge pages, where Linux offers them.

A decode step reads every weight once and each sequence's KV blocks: a few
hundred MB on 4 KB pages is tens of thousands of TLB misses per step, and
the blocks of a paged KV cache are read in no order the page walker can
guess. On 2 MB pages the same reads miss a few hundred times. Linux gives
them to memory that asks (madvise MADV_HUGEPAGE) when
/sys/kernel/mm/transparent_hugepage/enabled says "madvise" (the common
default) or "always"; torch's allocator asks only when THP_MEM_ALLOC_ENABLE
is set before torch starts, so specpage asks itself, for the tensors it
knows are large and long-lived: the models' weights (`pack`) and the KV
caches (`zeros`): a decode step reads them all, and fewer TLB misses
shorten it (docs/BENCHMARKS.md, "Huge pages").

Elsewhere (another OS, huge pages switched off, a CUDA tensor) these are
plain allocations. Pure torch and ctypes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
from functools import cache

import torch
from torch import nn

from specpage.core.arith import cdiv

HUGE_PAGE = 2 << 20  # bytes, x86-64 and arm64 with 4 KB base pages
MADV_HUGEPAGE = 14  # linux/mman.h
ALIGN = 64  # bytes between packed tensors: a cache line


@cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's madvise, where huge pages can be asked for; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as handle:
            if "[never]" in handle.read():
                return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def available() -> bool:
    return _madvise() is not None


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.empty, 2 MB-aligned and asked onto huge pages when it is on the
    CPU and at least one huge page long. Touch it only after: a page is
    huge or not when it is first written."""
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if device.type != "cpu" or nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + offset, nbytes, MADV_HUGEPAGE)  # advice: failing is harmless
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype,
          device: torch.device | str = "cpu") -> torch.Tensor:
    return empty(shape, dtype, device).zero_()


def pack(model: nn.Module) -> None:
    """Move the module's CPU parameters and buffers into one huge-page
    arena, in place (tensors shared between modules stay shared). Call it
    before anything keeps a reference to a weight's old storage."""
    tensors: dict[int, torch.Tensor] = {}  # by id: a tied weight counts once
    for module in model.modules():
        for group in (module._parameters, module._buffers):
            for tensor in group.values():
                # (an expanded placeholder holds no memory: it stays as it is)
                if tensor is not None and tensor.device.type == "cpu" and 0 not in tensor.stride():
                    tensors.setdefault(id(tensor), tensor)
    sizes = {key: cdiv(t.numel() * t.element_size(), ALIGN) * ALIGN for key, t in tensors.items()}
    total = sum(sizes.values())
    if _madvise() is None or total < HUGE_PAGE:
        return
    arena = empty((total,), torch.uint8)
    moved: dict[int, torch.Tensor] = {}
    offset = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        slot = arena[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        slot.copy_(tensor.detach())
        if isinstance(tensor, nn.Parameter):
            slot = nn.Parameter(slot, requires_grad=tensor.requires_grad)
        moved[key] = slot
        offset += sizes[key]
    for module in model.modules():
        for group in (module._parameters, module._buffers):
            for name, tensor in list(group.items()):
                if tensor is not None and id(tensor) in moved:
                    group[name] = moved[id(tensor)]
