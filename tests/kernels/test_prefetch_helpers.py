"""The native kernels' prefetch helpers are always inlined.

A function that only prefetches has no effect that GCC's interprocedural
analysis sees: compiled apart, it is taken for a pure function and every
call to it is deleted, silently. That took the paged attention kernel's
reading ahead away (one sequence's verify span of 5 at 600 positions,
SmolLM2's shape, 30 layers: 2.6-3.0 ms with it gone, 1.55 ms restored) and,
earlier, the int4 products'. A helper whose name says it prefetches must
carry always_inline.
"""

import re
from pathlib import Path

import specpage.kernels.cpu as cpu_kernels

SOURCES = sorted(Path(cpu_kernels.__file__).parent.glob("*.cpp")) + sorted(
    Path(cpu_kernels.__file__).parent.glob("*.h"))
# a definition's return type and name, from the start of its line (templates aside)
DEFINITION = re.compile(r"^(?P<head>[^\n;{}]*?)\bvoid\s+(?P<name>prefetch\w*)\s*\(", re.M)


def test_the_sources_are_found():
    assert any(path.name == "paged_attention.cpp" for path in SOURCES)


def test_every_prefetch_helper_is_always_inlined():
    helpers = []
    for path in SOURCES:
        for match in DEFINITION.finditer(path.read_text()):
            helpers.append(f"{path.name}:{match['name']}")
            assert "always_inline" in match["head"], (
                f"{path.name}: {match['name']} must be __attribute__((always_inline))")
    # the helpers this rule is about exist (a renamed one would escape it)
    assert {"paged_attention.cpp:prefetch_bytes", "paged_attention.cpp:prefetch_ahead",
            "int4_gemv.cpp:prefetch_tile", "vec.h:prefetch_ahead"} <= set(helpers)
