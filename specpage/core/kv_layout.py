"""KV memory arithmetic: bytes per token, blocks that fit a budget, and the
position utilization of paging versus a fixed max-length reservation.

    bytes_per_token = 2 · layers · kv_heads · head_dim · dtype_bytes   (K and V)
    allocated(n, B) = B · ceil(n / B)          tail waste = allocated − n
    U = Σ n / Σ B · ceil(n / B)

Position utilization is not device utilization: block tables, workspace and
alignment are counted separately (block-table bytes) or not at all.

Sliding-window layers (Gemma 3's local layers, say) read only the last
`window` positions. In one block table shared by every layer, a block stays
while any layer may read it, so they hold every position. A separate table
for the windowed layers (the engine's, core/layer_groups.py) frees each
block once the window has left it behind, and holds at most the blocks that
the last `window` positions fall in:

    windowed blocks(n, B, W) = (n − 1) // B − max(0, n − W) // B + 1

`windowed_tables` prices both, per block size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import msgspec

from specpage.core.arith import cdiv

DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float8": 1, "fp8": 1, "int8": 1,
}  # fmt: skip
BLOCK_TABLE_ENTRY_BYTES = 4  # int32 block ids


class KvShape(msgspec.Struct, frozen=True):
    """What one model's KV costs per token."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    windowed_layers: int = 0  # of `layers`, those that attend within a sliding window
    window: int = 0  # the keys a windowed layer sees back from a position, itself included

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.bytes_per_layer_token

    @property
    def bytes_per_layer_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, path: str | Path, dtype: str | None = None) -> KvShape:
        """Read an HF ``config.json`` (or the folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        config = json.loads(path.read_text())
        heads = config["num_attention_heads"]
        dtype = dtype or config.get("torch_dtype") or config.get("dtype") or "float32"
        return cls(
            layers=config["num_hidden_layers"],
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            dtype_bytes=dtype_bytes(dtype),
        )


class Paging(msgspec.Struct, frozen=True):
    """Position accounting of one block size over a set of sequences."""

    block_size: int
    allocated: int
    valid: int
    tail_waste: int
    utilization: float
    block_table_bytes: int


class Reservation(msgspec.Struct, frozen=True):
    """Position accounting of a fixed max-length reservation per sequence."""

    max_length: int
    allocated: int
    valid: int
    waste: int
    utilization: float


class WindowedTables(msgspec.Struct, frozen=True):
    """One model's KV over a set of sequences at one block size: in one
    block table for every layer (the pool's), and with a table of its own
    for the windowed layers that frees blocks the window has left."""

    block_size: int
    one_table_bytes: int
    windowed_table_bytes: int
    saving: float  # 1 - windowed / one table


def windowed_blocks(length: int, block_size: int, window: int) -> int:
    """Blocks the last `window` positions of a sequence of `length` fall in."""
    if window <= 0 or window >= length:
        return cdiv(length, block_size)
    return (length - 1) // block_size - (length - window) // block_size + 1


def windowed_tables(lengths: Sequence[int], block_size: int, shape: KvShape) -> WindowedTables:
    _check_lengths(lengths)
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    if not 0 <= shape.windowed_layers <= shape.layers:
        raise ValueError(f"windowed layers ({shape.windowed_layers}) must be 0 .. "
                         f"the model's {shape.layers}")
    per_block = block_size * shape.bytes_per_layer_token
    every = sum(cdiv(n, block_size) for n in lengths)
    windowed = sum(windowed_blocks(n, block_size, shape.window) for n in lengths)
    full_layers = shape.layers - shape.windowed_layers
    one = shape.layers * every * per_block
    separate = (full_layers * every + shape.windowed_layers * windowed) * per_block
    return WindowedTables(block_size, one, separate, 1 - separate / one)


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}") from None


def paging(lengths: Sequence[int], block_size: int) -> Paging:
    _check_lengths(lengths)
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    blocks = sum(cdiv(n, block_size) for n in lengths)
    allocated = blocks * block_size
    valid = sum(lengths)
    return Paging(
        block_size=block_size,
        allocated=allocated,
        valid=valid,
        tail_waste=allocated - valid,
        utilization=valid / allocated,
        block_table_bytes=blocks * BLOCK_TABLE_ENTRY_BYTES,
    )


def reservation(lengths: Sequence[int], max_length: int) -> Reservation:
    _check_lengths(lengths)
    if max(lengths) > max_length:
        raise ValueError(f"a length ({max(lengths)}) exceeds the reservation ({max_length})")
    allocated = max_length * len(lengths)
    valid = sum(lengths)
    return Reservation(max_length, allocated, valid, allocated - valid, valid / allocated)


def blocks_that_fit(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """Blocks of a pool shared by the models whose per-token bytes are summed."""
    return budget_bytes // (block_size * bytes_per_token)


def parse_bytes(text: str) -> int:
    """'8GiB', '512MB', '1e9' or a plain integer, in bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", text)
    if not match:
        raise ValueError(f"cannot read a byte count from {text!r} (try 8GiB or 512MB)")
    number, unit = float(match.group(1)), (match.group(2) or "B")
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    scale = 1 if unit == "B" else (1024 if "i" in unit else 1000) ** powers[unit[0]]
    return int(number * scale)


def _check_lengths(lengths: Sequence[int]) -> None:
    if not lengths:
        raise ValueError("no sequence lengths given")
    if min(lengths) < 1:
        raise ValueError(f"sequence lengths must be >= 1, got {min(lengths)}")
