"""The daemon fixes glibc's mmap threshold (serve/allocator.py): a large
block freed no longer raises it, so blocks past it keep coming from
mappings of their own, which go back to the system when freed. Read from
the chunk's own header (glibc's IS_MMAPPED bit), in a fresh process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")

PROBE = """
import ctypes, sys
from specpage.serve.allocator import MMAP_THRESHOLD, fix_mmap_threshold
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mapped(size):
    block = libc.malloc(size)
    bit = ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value & 2
    libc.free(block)
    return bool(bit)

fixed = fix_mmap_threshold() if sys.argv[1] == "fix" else False
big = libc.malloc(16 << 20)  # mapped; freeing it raises a dynamic threshold to 16 MiB
libc.free(big)
print(fixed, mapped(MMAP_THRESHOLD + (2 << 20)), mapped(MMAP_THRESHOLD // 4))
"""


def probe(mode: str, env: dict[str, str] | None = None) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                          env={**environment, **(env or {})}, timeout=120, check=True)
    return done.stdout.strip()


def test_a_freed_large_block_no_longer_moves_the_threshold():
    assert probe("leave") == "False False False"  # glibc's own: 6 MiB from the heap
    assert probe("fix") == "True True False"  # fixed: past 4 MiB mapped, below from the heap


def test_an_operators_own_threshold_is_left_alone():
    assert probe("fix", {"MALLOC_MMAP_THRESHOLD_": str(64 << 20)}) == "False False False"
