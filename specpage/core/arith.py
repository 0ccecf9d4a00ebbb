"""Integer arithmetic the layout of blocks and buffers needs."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: the blocks (or units of b) that hold a items."""
    return -(-a // b)
