"""A native kernel build left half done by a killed process does not stop
later ones: torch's `lock` file it left is cleared by the next builder,
which holds an advisory lock the kernel drops when its holder dies."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specpage.kernels.cpu import native

HANG_GUARD_S = 900  # a build under a stale lock would wait forever; not a speed bound


@pytest.mark.skipif(native.native_kernels() is None, reason="no native kernels here")
def test_a_stale_build_lock_is_cleared_by_the_next_builder():
    from specpage.models.fetch import cache_dir

    folder = cache_dir() / "kernels" / f"cpu-{native.build_key()}"
    (folder / "lock").touch()  # what a builder killed mid-build leaves
    loaded = subprocess.run(
        [sys.executable, "-c", "from specpage.kernels.cpu.native import native_kernels; "
         "print(native_kernels() is not None)"],
        capture_output=True, text=True, timeout=HANG_GUARD_S, check=True)
    assert loaded.stdout.strip() == "True"
    assert not (folder / "lock").exists()


def test_the_loader_finds_every_kernel_source_beside_it() -> None:
    """The build reads the C++ sources shipped beside the loader: none found
    would leave every machine on the torch ops without a word but a log line."""
    names = {path.name for path in native.SOURCES}
    assert names == {"bf16_gemv.cpp", "bf16_panels.cpp", "decoder_stack.cpp", "fused_ops.cpp",
                     "int4_gemv.cpp", "kquant_gemv.cpp", "paged_attention.cpp", "read_through.cpp",
                     "sampling.cpp"}
    assert [path.name for path in native.HEADERS] == ["vec.h"]


@pytest.mark.skipif(native.native_kernels() is None, reason="no native kernels here")
@pytest.mark.parametrize("nbytes", [1, 255, 256, 1000, 64 * 1024 * 3 + 77])
def test_read_through_reads_every_byte(nbytes: int) -> None:
    """The benches' read rate (bench/common.py read_bandwidth) comes from
    read_through, the OR of every byte of a tensor: one byte set anywhere,
    its first, a middle one or its last (past the last whole pass), is
    seen."""
    import functools
    import operator

    import torch

    assert torch.ops.specpage_cpu.read_through(torch.zeros(nbytes, dtype=torch.uint8)) == 0
    for place, value in ((0, 0x01), (nbytes // 2, 0x40), (nbytes - 1, 0x80)):
        data = torch.zeros(nbytes, dtype=torch.uint8)
        data[place] = value
        assert torch.ops.specpage_cpu.read_through(data) == value
    mixed = torch.arange(nbytes, dtype=torch.int64).remainder(256).to(torch.uint8)
    assert torch.ops.specpage_cpu.read_through(mixed) == functools.reduce(
        operator.or_, range(min(nbytes, 256)))
