"""x @ W.T on the CPU the fastest way it has for the row count: native bf16
kernels for a few rows (kernels/cpu/bf16_gemv.cpp, bf16_panels.cpp), oneDNN
with the weight reordered once, or BLAS with the rows padded to a count it is
fast at. Which way runs for which rows was measured (bench/cpu_linear.py);
the figures are in docs/BENCHMARKS.md, "CPU products"."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from specpage.core.arith import cdiv
from specpage.kernels.cpu import features as cpu
from specpage.kernels.cpu.native import loaded_kernels

# One kernel call that computes x @ W.T: the op and its weight operands
# (x first, then these), as layers/native_stack.py passes them on.
Product = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]

# BLAS is slow for a few rows against a large weight, and its speed by row
# count is uneven, so a few rows are padded with zero rows to the nearest
# fast count (docs/BENCHMARKS.md, "CPU products: BLAS by row count").
FEW_ROWS = 32


def padded_rows(rows: int) -> int:
    if rows in (1, 3):
        return rows + 1
    if 9 <= rows <= 16:
        return 16
    if rows > 16:
        return cdiv(rows, 8) * 8
    return rows


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.device.type != "cpu" or x.shape[0] > FEW_ROWS:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    y = (weight @ x.contiguous().T).T[:rows]  # x.T transposed, as BLAS is fast at
    return y if bias is None else y + bias


# With AVX-512, oneDNN on a weight reordered once into its blocked layout
# beats both BLAS ways from these row counts on (docs/BENCHMARKS.md, "CPU
# products: oneDNN"); fewer rows, and every product without AVX-512, take
# few_rows_linear.
ONEDNN_FROM_ROWS = {torch.float32: 3, torch.bfloat16: 1}


def uses_onednn(weight: torch.Tensor, rows: int) -> bool:
    """Whether a CPU product of `rows` rows by this weight runs on oneDNN."""
    first = ONEDNN_FROM_ROWS.get(weight.dtype)
    return first is not None and rows >= first and _onednn_usable(weight.dtype)


@functools.cache
def _onednn_usable(dtype: torch.dtype) -> bool:
    if not (cpu.has_avx512() and torch.backends.mkldnn.is_available()):  # type: ignore[no-untyped-call]
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedWeight:
    """A weight reordered once into a product's own layout (oneDNN's blocked
    one, the native panel kernel's), each remade when the weight it came from
    changes (another dtype, device or storage). One more copy of the weight in
    memory per layout used: the plain one stays for anything that reads
    `.weight`."""

    def __init__(self) -> None:
        # layout -> (the weight's storage and dtype it was made from, the copy)
        self._made: dict[str, tuple[tuple[int, torch.dtype], torch.Tensor]] = {}

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """oneDNN's layout, for torch.ops.mkldnn._linear_pointwise."""
        return self._remade("onednn", weight, lambda w: torch.ops.mkldnn._reorder_linear_weight(
            w, FEW_ROWS))

    def panels(self, weight: torch.Tensor) -> torch.Tensor:
        """The native panel layout (kernels/cpu/bf16_panels.cpp)."""
        return self._remade("panels", weight,
                            lambda w: bf16_kernels().bf16_panels(w))  # type: ignore[union-attr]

    def _remade(self, layout: str, weight: torch.Tensor,
                make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        source = (weight.data_ptr(), weight.dtype)
        made = self._made.get(layout)
        if made is None or made[0] != source:
            with torch.no_grad():
                made = (source, make(weight.detach()))
            self._made[layout] = made
        return made[1]


# Where the CPU has AVX-512 BF16, bf16 products of a few rows run on native
# kernels: up to GEMV_MAX_ROWS on kernels/cpu/bf16_gemv.cpp, which reads each
# weight row once, front to back, prefetching ahead (bound by reading the
# weight); up to PANELS_MAX_ROWS on kernels/cpu/bf16_panels.cpp, with the
# weight packed once more into panels of outputs (bound by the multiplies).
# oneDNN's prepacked product takes more rows. The bounds are where each was
# measured fastest (docs/BENCHMARKS.md, "CPU products: native bf16 kernels").
# Where the CPU has AMX, oneDNN runs bf16 on its tiles and beats the panels
# at every row count past the few-row kernel's (2.3x at 32 rows, 3.8x at 64
# with SmolLM2-135M's layers; the same section), so there no product takes
# the panels.
GEMV_MAX_ROWS = 8
PANELS_MAX_ROWS = 64


def gemv_takes(weight: torch.Tensor, rows: int) -> bool:
    """Whether the native few-row kernel takes bf16 x of `rows` rows by this
    weight (it has no autograd: callers check that too)."""
    return (rows <= GEMV_MAX_ROWS and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.shape[0] % 16 == 0
            and weight.shape[1] % 32 == 0 and weight.is_contiguous()
            and bf16_kernels() is not None)


def panels_take(weight: torch.Tensor, rows: int) -> bool:
    """Whether the native panel kernel takes bf16 x of `rows` rows by this
    weight (rows the few-row kernel does not take; no autograd)."""
    return (GEMV_MAX_ROWS < rows <= PANELS_MAX_ROWS and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.shape[0] % 16 == 0
            and weight.shape[1] % 2 == 0 and weight.is_contiguous()
            and bf16_kernels() is not None and not cpu.has_amx())


@functools.cache
def bf16_kernels() -> object | None:
    """The native kernels where this build has AVX-512 BF16 (bf16_gemv,
    bf16_panels, and int4_gemv for layers/quant.py); None elsewhere."""
    kernels = loaded_kernels()
    return kernels if kernels is not None and kernels.has_bf16_gemv() else None


def native_product(weight: torch.Tensor, packed: PackedWeight, rows: int) -> Product | None:
    """The native kernel call, with its weight operands, for bf16 x of `rows`
    rows by this weight (no bias); None where no native kernel takes it."""
    if gemv_takes(weight, rows):
        return bf16_kernels().bf16_gemv.default, (weight,)  # type: ignore[union-attr]
    if panels_take(weight, rows):
        return (bf16_kernels().bf16_panels_product.default,  # type: ignore[union-attr]
                (packed.panels(weight), weight.shape[0]))
    return None


# Row-invariant products (engine.deterministic): each row of x @ W.T comes out
# bit for bit the same whatever other rows share the call, so a sequence's
# logits do not depend on the batch, the prefill chunks or the proposals
# verified beside it. The ways above are chosen by row count, and they sum
# in different orders (the few-row kernel, the panels, oneDNN, BLAS's gemv
# and gemm), so in this mode every product of a weight takes one way:
# - bf16 on the native few-row kernel, in passes of at most GEMV_MAX_PASS
#   rows: each output's dot product runs along the weight's row in one
#   order whatever the rows (kernels/cpu/bf16_gemv.cpp);
# - bf16 where neither that kernel nor oneDNN runs it, on torch's own
#   product as cpu_linear takes it (few_rows_linear), which sums each output
#   along its row alone in both of its forms;
# - every other product in tiles of INVARIANT_TILE rows, the last one padded
#   with zero rows, as weight @ tile.T: BLAS then always sees one shape, so
#   one kernel and one summation order, which does not depend on where in
#   the tile a row sits (measured: the tests below check it on the CPU they
#   run on; x @ weight.T in tiles of 2 did depend on it for a 64 x 211 weight).
# int4 layers keep their own kernels (layers/quant.py). tests/layers/
# test_row_invariance.py checks every way against each row computed alone.
GEMV_MAX_PASS = 16  # bf16_gemv's most rows a call
INVARIANT_TILE = 4  # a decode step's one row costs four; a large weight's read dominates


class _Mode(threading.local):
    row_invariant = False


_mode = _Mode()


@contextlib.contextmanager
def row_invariant(on: bool) -> Iterator[None]:
    """Products of this thread in the block are row-invariant (on) or the fastest (off)."""
    before = _mode.row_invariant
    _mode.row_invariant = on
    try:
        yield
    finally:
        _mode.row_invariant = before


def row_invariant_on() -> bool:
    return _mode.row_invariant


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                     ) -> torch.Tensor:
    """x [rows, in] @ weight.T [+ bias], each row as if it were alone (see above)."""
    rows = x.shape[0]
    if x.dtype == torch.bfloat16 and gemv_takes(weight, 1) and not torch.is_grad_enabled():
        kernel = bf16_kernels().bf16_gemv  # type: ignore[union-attr]
        x = x.contiguous()
        y = torch.cat([kernel(x[r : r + GEMV_MAX_PASS], weight)
                       for r in range(0, rows, GEMV_MAX_PASS)]) if rows else x.new_empty(
            0, weight.shape[0])
    elif weight.dtype == torch.bfloat16 and not _onednn_usable(torch.bfloat16):
        # torch's own bf16 product, in either of few_rows_linear's forms: one
        # order per output
        y = few_rows_linear(x, weight)
    else:
        padded = cdiv(rows, INVARIANT_TILE) * INVARIANT_TILE
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        # weight @ tile.T: BLAS's fast form for few columns (few_rows_linear's)
        y = torch.cat([(weight @ x[r : r + INVARIANT_TILE].T).T
                       for r in range(0, padded, INVARIANT_TILE)])[:rows]
    return y if bias is None else y + bias


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: PackedWeight) -> torch.Tensor:
    """x [rows, in] @ weight.T [+ bias] the fastest way this CPU has for the
    rows, or row-invariant where the thread asked for it (row_invariant)."""
    if _mode.row_invariant and x.device.type == "cpu":
        return invariant_linear(x, weight, bias)
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
        call = native_product(weight, packed, x.shape[0])
        if call is not None:
            kernel, operands = call
            y = kernel(x.contiguous(), *operands)
            return y if bias is None else y + bias
    if x.device.type == "cpu" and uses_onednn(weight, x.shape[0]):
        y = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), packed.of(weight), bias, "none", [], "")
        return y
    return few_rows_linear(x, weight, bias)


def direct_bf16_product(weight: torch.Tensor, packed: PackedWeight,
                        rows: int) -> Product | None:
    """The one kernel call cpu_linear makes for bf16 x of `rows` rows by this
    weight (no bias), with its weight operands; None where it makes another."""
    if _mode.row_invariant:  # the native stack then only where one pass takes the rows
        if rows <= GEMV_MAX_PASS and gemv_takes(weight, rows):
            return bf16_kernels().bf16_gemv.default, (weight,)  # type: ignore[union-attr]
        return None
    call = native_product(weight, packed, rows)
    if call is None and weight.dtype == torch.bfloat16 and uses_onednn(weight, rows):
        call = (torch.ops.mkldnn._linear_pointwise.default,
                (packed.of(weight), None, "none", [], ""))
    return call
