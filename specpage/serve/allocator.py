"""The C allocator's settings for a long-running daemon.

glibc serves a block of at least its mmap threshold from a mapping of its
own, returned to the system when freed, and smaller ones from its heaps,
whose freed space it keeps. Each time a mapped block is freed it raises
the threshold to that block's size (up to 32 MiB), so the step's larger
buffers then come from the heaps, and each forward of a row count not
seen before left some of them behind: about 10 MB of resident set per new
shape of the q4 target's forward (docs/BENCHMARKS.md, "soak"), which a
daemon's varying batches reach for hours. A fixed threshold turns that
adjustment off; at MMAP_THRESHOLD the growth per new shape fell to about
0.4 MB and forwards were level in time.

An operator's own MALLOC_MMAP_THRESHOLD_ is left as it is; elsewhere than
glibc nothing changes.

oneDNN, which runs the dense products of many rows, keeps the primitives
of its last 1,024 shapes, each with its own copy of the weight in the
layout it computes in: a forward of a new row count adds one per product.
In one process forwarding 160 new row counts of the q4 target (43-202
rows), the resident set grew by 277 MB at oneDNN's default and by 40 MB
with ONEDNN_PRIMITIVE_CACHE_CAPACITY at 32, forwards level in time (the
recreated primitives cost less than the steps' spread). bound_onednn_cache
sets that before the first primitive is made; an operator's own value is
left as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
MMAP_THRESHOLD = 4 << 20  # bytes; 1 MiB left more behind per shape, 128 KiB more still


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD; whether it was set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the process's own C library
    set_ = bool(libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD)))
    if set_:
        log.debug("C allocator: mmap threshold fixed", extra={"bytes": MMAP_THRESHOLD})
    return set_


ONEDNN_CACHE_CAPACITY = 32  # primitives oneDNN keeps (its default: 1,024)


def bound_onednn_cache() -> bool:
    """Bound oneDNN's primitive cache at ONEDNN_CACHE_CAPACITY; whether set.
    oneDNN reads the setting when it makes its first primitive, so this runs
    before the models load."""
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in os.environ:
        return False
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(ONEDNN_CACHE_CAPACITY)
    log.debug("oneDNN: primitive cache bounded", extra={"primitives": ONEDNN_CACHE_CAPACITY})
    return True
