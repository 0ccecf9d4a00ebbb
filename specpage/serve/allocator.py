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
