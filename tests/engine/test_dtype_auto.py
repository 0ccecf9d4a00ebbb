"""model.dtype = "auto": bf16 where the CPU's bf16 matmuls are native (or on
CUDA), fp32 elsewhere; the daemon's config defaults to it, while loading
without a dtype (LLM(), specpage generate) stays fp32 on CPU."""

import pytest
import torch

from specpage.config import ModelSection
from specpage.kernels.cpu import features as cpu
from specpage.models.loader import load_model, resolve_dtype
from tests.support.checkpoints import tiny_checkpoint

CPU = torch.device("cpu")


@pytest.mark.parametrize(("flags", "dtype"), [
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"avx2", "amx_bf16", "amx_tile"}, torch.bfloat16),
    ({"avx2", "avx512f"}, torch.float32),
    ({"avx2", "fma"}, torch.float32),
    (set(), torch.float32),  # /proc/cpuinfo unreadable
])
def test_auto_follows_the_cpus_bf16_support(monkeypatch, flags, dtype):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    assert resolve_dtype("auto", CPU) == dtype
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype(None, CPU) == torch.float32
    assert resolve_dtype("fp32", CPU) == torch.float32


def test_the_daemon_defaults_to_auto_and_loading_alone_to_fp32(tmp_path):
    assert ModelSection().dtype == "auto"
    tiny_checkpoint(tmp_path)
    assert load_model(tmp_path).model.embed_tokens.weight.dtype == torch.float32
    expected = torch.bfloat16 if cpu.has_fast_bf16() else torch.float32
    assert load_model(tmp_path, "auto").model.embed_tokens.weight.dtype == expected
