"""Weights and KV caches on transparent huge pages: the same values, the
same sharing, and plain tensors where huge pages cannot be had."""

import ctypes
import mmap

import pytest
import torch
from torch import nn

from specpage.kernels.cpu import hugepages


def advised(address: int) -> bool:
    """Whether the mapping holding this address asked for huge pages (its
    VmFlags carry "hg"), whatever pages the kernel has given it so far."""
    inside = False
    with open("/proc/self/smaps") as handle:
        for line in handle:
            first = line.split(" ", 1)[0]
            if "-" in first and not first.endswith(":"):
                low, high = (int(part, 16) for part in first.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    return False


needs_huge_pages = pytest.mark.skipif(not hugepages.available(),
                                      reason="no transparent huge pages here")


@needs_huge_pages
def test_a_large_tensor_is_aligned_and_on_huge_pages():
    cache = hugepages.zeros((8, 2, 64, 16, 3, 64), torch.bfloat16)  # 12 MB
    assert cache.data_ptr() % hugepages.HUGE_PAGE == 0
    assert cache.is_contiguous() and not cache.any()
    assert advised(cache.data_ptr())
    # A plain anonymous mapping has not asked. (Not a torch tensor: malloc may
    # reuse memory an earlier huge-page tensor advised, or be set, as glibc's
    # malloc.hugetlb tunable does, to advise every mapping it makes itself.)
    plain = mmap.mmap(-1, 2 * hugepages.HUGE_PAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(plain))
    assert not advised(address)


def test_small_and_non_cpu_tensors_are_plain():
    small = hugepages.zeros((4, 4), torch.float32)
    assert small.shape == (4, 4) and not small.any()
    meta = hugepages.empty((1 << 22,), torch.float32, "meta")
    assert meta.device.type == "meta"


def test_pack_keeps_values_sharing_and_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 256), nn.Linear(256, 256), nn.Linear(256, 4096))
    model[2].weight = model[0].weight  # tied, as an LM head to its embedding
    model.register_buffer("table", torch.arange(7))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    hugepages.pack(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert model[2].weight is model[0].weight
    assert isinstance(model[1].weight, nn.Parameter)
    out = model[2](model[1](model[0](torch.tensor([1, 2]))))  # still a working module
    assert out.shape == (2, 4096)
    if hugepages.available():  # one advised arena: neighbours within it
        assert advised(model[1].weight.data_ptr())
        ptrs = sorted(t.data_ptr() for t in (model[0].weight, model[1].weight, model[1].bias))
        assert ptrs[-1] - ptrs[0] < 4096 * 256 * 4 + 256 * 256 * 4 + 1024


def test_pack_leaves_an_expanded_placeholder_holding_no_memory():
    """A weight kept only as a placeholder of its shape (one zero, expanded:
    a K-quant head's dense copy, models/quant_load.py) is not copied into
    the arena, where it would take its whole size."""
    model = nn.Sequential(nn.Embedding(4096, 256), nn.Linear(256, 4096, bias=False))
    placeholder = torch.zeros((), dtype=torch.bfloat16).expand(4096, 256)
    model[1].weight = nn.Parameter(placeholder, requires_grad=False)
    embedding = model[0].weight.detach().clone()
    hugepages.pack(model)
    assert model[1].weight.stride() == (0, 0) and model[1].weight.shape == (4096, 256)
    assert model[1].weight.untyped_storage().nbytes() == 2
    assert torch.equal(model[0].weight, embedding)
