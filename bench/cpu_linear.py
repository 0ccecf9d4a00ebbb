"""The CPU's linear products at the few rows a decode or verify step brings:
for each dtype and row count, the time of every product of SmolLM2-135M's
30 layers (qkv, o, gate_up, down) by each way torch offers to run them, and
the vocabulary projection on its own. The ways run alternately, each
round's figure is the least of a few passes (other work on a shared machine
only ever adds time), and the JSON gives the median of the rounds. This is
how the table in specpage.models.decoder (ONEDNN_FROM_ROWS) was chosen.

Ways: F.linear (MKL sgemm, or oneDNN for bf16); W @ x.T with the rows
padded to a count BLAS is fast at (specpage.models.decoder.few_rows_linear);
oneDNN with the weight reordered once into its blocked layout
(torch.ops.mkldnn._linear_pointwise); for the vocabulary projection also
x @ W.T with W.T held contiguous; for bf16, where the CPU has AVX-512 BF16,
specpage's native kernel (kernels/cpu/bf16_gemv.cpp) up to its 16 rows,
and its panel kernel (kernels/cpu/bf16_panels.cpp) from 17 to 64 rows.
This is how decoder.py's GEMV_MAX_ROWS and PANELS_MAX_ROWS were chosen.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish, machine  # noqa: E402
from specpage.layers.products import bf16_kernels, few_rows_linear  # noqa: E402

# SmolLM2-135M: (out, in) of each layer's products, 30 layers, vocabulary 49,152.
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30
VOCAB, HIDDEN = 49152, 576
PASSES = 6  # passes per round; a round keeps the least
NATIVE_MAX_ROWS = 16
PANELS_BENCH_MAX_ROWS = 64


def native_gemv(dtype: torch.dtype, rows: int) -> Any:
    """The native bf16 product where it applies to these products, else None."""
    kernels = bf16_kernels()
    if dtype != torch.bfloat16 or rows > NATIVE_MAX_ROWS or kernels is None:
        return None
    return kernels.bf16_gemv


def least_ms(fn: Callable[[], object], passes: int) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def native_panels(dtype: torch.dtype, rows: int) -> Any:
    """The native panel product (kernels/cpu/bf16_panels.cpp) where it applies, else None."""
    kernels = bf16_kernels()
    if dtype != torch.bfloat16 or not NATIVE_MAX_ROWS < rows <= PANELS_BENCH_MAX_ROWS or (
            kernels is None):
        return None
    return kernels.bf16_panels_product


def layer_ways(dtype: torch.dtype, rows: int) -> dict[str, Callable[[], object]]:
    weights = [[torch.randn(o, i, dtype=dtype) * 0.02 for o, i in LAYER_SHAPES]
               for _ in range(LAYERS)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in layer]
              for layer in weights]
    inputs = {i: torch.randn(rows, i, dtype=dtype) for _, i in LAYER_SHAPES}

    def every(product: Callable[[torch.Tensor, int, int], object]) -> Callable[[], None]:
        def run() -> None:
            for layer in range(LAYERS):
                for j, (_, i) in enumerate(LAYER_SHAPES):
                    product(inputs[i], layer, j)
        return run

    ways = {
        "linear": every(lambda x, layer, j: F.linear(x, weights[layer][j])),
        "wxt": every(lambda x, layer, j: few_rows_linear(x, weights[layer][j])),
        "onednn": every(lambda x, layer, j: torch.ops.mkldnn._linear_pointwise(
            x, packed[layer][j], None, "none", [], "")),
    }
    gemv = native_gemv(dtype, rows)
    if gemv is not None:
        ways["native"] = every(lambda x, layer, j: gemv(x, weights[layer][j]))
    panels = native_panels(dtype, rows)
    if panels is not None:
        packs = [[bf16_kernels().bf16_panels(w) for w in layer] for layer in weights]
        ways["panels"] = every(lambda x, layer, j: panels(x, packs[layer][j],
                                                          weights[layer][j].shape[0]))
    return ways


def head_ways(dtype: torch.dtype, rows: int) -> dict[str, Callable[[], object]]:
    head = torch.randn(VOCAB, HIDDEN, dtype=dtype) * 0.02
    head_t = head.T.contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(head, rows)
    x = torch.randn(rows, HIDDEN, dtype=dtype)
    ways = {
        "linear": lambda: F.linear(x, head),
        "wxt": lambda: few_rows_linear(x, head),
        "xwt": lambda: x @ head_t,
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    }
    gemv = native_gemv(dtype, rows)
    if gemv is not None:
        ways["native"] = lambda: gemv(x, head)
    return ways


def measure(ways: dict[str, Callable[[], object]],
            rounds: int) -> dict[str, dict[str, float]]:
    """Per way, the median of its rounds with the min-max spread, in ms."""
    figures: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for fn in ways.values():
        fn()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            figures[name].append(least_ms(ways[name], PASSES))
    return {name: {"median": statistics.median(values), "min": min(values), "max": max(values)}
            for name, values in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,24,32,48,64")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.quick:
        rows_list = [r for r in rows_list if r in (1, 4, 32)]
    rounds = 2 if args.quick else 4
    results: dict[str, Any] = {}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            continue
        table: dict[str, Any] = {}
        for rows in rows_list:
            table[str(rows)] = {"layers_ms": measure(layer_ways(dtype, rows), rounds),
                                "head_ms": measure(head_ways(dtype, rows), rounds)}
            print(f"{name} rows {rows:>2}: layers "
                  + " ".join(f"{k} {v['median']:6.2f}"
                             for k, v in table[str(rows)]["layers_ms"].items())
                  + " | head "
                  + " ".join(f"{k} {v['median']:5.2f}"
                             for k, v in table[str(rows)]["head_ms"].items()),
                  file=sys.stderr, flush=True)
        results[name] = table
    finish("cpu_linear", {"bench": "cpu_linear", "ms": results, "rounds": rounds,
                          "machine": machine()})


if __name__ == "__main__":
    main()
