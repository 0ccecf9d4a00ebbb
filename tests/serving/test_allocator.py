"""The daemon fixes glibc's mmap threshold (serve/allocator.py): a large
block freed no longer raises it, so blocks past it keep coming from
mappings of their own, which go back to the system when freed. Read from
the chunk's own header (glibc's IS_MMAPPED bit), in a fresh process. And it
bounds oneDNN's primitive cache."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")

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


@glibc
def test_a_freed_large_block_no_longer_moves_the_threshold():
    assert probe("leave") == "False False False"  # glibc's own: 6 MiB from the heap
    assert probe("fix") == "True True False"  # fixed: past 4 MiB mapped, below from the heap


@glibc
def test_an_operators_own_threshold_is_left_alone():
    assert probe("fix", {"MALLOC_MMAP_THRESHOLD_": str(64 << 20)}) == "False False False"


CACHE_PROBE = """
import os
from specpage.serve.allocator import ONEDNN_CACHE_CAPACITY, bound_onednn_cache
print(bound_onednn_cache(), os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], ONEDNN_CACHE_CAPACITY)
"""


def cache_probe(env: dict[str, str]) -> list[str]:
    environment = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    done = subprocess.run([sys.executable, "-c", CACHE_PROBE], capture_output=True, text=True,
                          env={**environment, **env}, timeout=120, check=True)
    return done.stdout.split()


def test_onednns_primitive_cache_is_bounded_unless_the_operator_set_it():
    """oneDNN keeps a weight's copy with each cached primitive, one per new
    row count: the daemon bounds the cache before the models load, and an
    operator's own capacity stays."""
    set_, value, capacity = cache_probe({})
    assert set_ == "True" and value == capacity and int(capacity) < 1024
    assert cache_probe({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "500"})[:2] == ["False", "500"]
