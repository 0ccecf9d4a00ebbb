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
                     "int4_gemv.cpp", "kquant_gemv.cpp", "paged_attention.cpp", "sampling.cpp"}
    assert [path.name for path in native.HEADERS] == ["vec.h"]
