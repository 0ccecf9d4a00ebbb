"""One product's time on K-quant weights (specpage/layers/kquant.py,
kernels/cpu/kquant_gemv.cpp) against the Q4_0 int8x kernel and the dense bf16
product, for the projections of a ~1B Llama (hidden 2048, intermediate 8192,
8 KV heads of 64) and SmolLM2-135M's down projection (its other weights take
576 inputs, not whole super-blocks of 256: llama.cpp stores those in other
types), on 1 to 128 rows of bf16 x:

- q4_k, q5_k, q6_k: the int8 kernels (x to int8 per 256, vpdpbusd);
- q4_k_dense: the weights dequantized to bf16 a tile at a time, then
  oneDNN (KQuantLinear.dense_product, its way from DENSE_FROM_ROWS rows);
- q4_0_int8x: Q4_0 blocks on int8x_gemv (an Int4Linear's kernel), x in int8
  per 32;
- bf16: the dense weights on the decoder's own product (cpu_linear: the
  native few-row kernel, oneDNN past it), reordered once, its best.

Each system's weights are copies enough to fill WORKING_SET bytes, taken in
turn, so that each product reads its weights from memory as a decode step
does, not from the cache the previous call left. Rounds in rotated order
(bench/common.py); per system and row count the median time of a call,
min-max over rounds, the GB/s its weight bytes make, and the floor: those
bytes at bench/common.py's read rate (a large buffer read alone),
measured in the same rounds. Outputs are compared too: each K type's
relative error against its weights' exact product with x.

    python bench/kquant.py [--quick]
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish, machine, memory_rates, parse_args, rotated, rounds  # noqa: E402
from specpage.layers import kquant  # noqa: E402
from specpage.layers.kquant import FORMATS, SUPER_BLOCK, KQuantBlocks, KQuantLinear  # noqa: E402
from specpage.layers.products import PackedWeight, bf16_kernels, cpu_linear  # noqa: E402
from specpage.layers.quant import Int4Blocks, int8x_kernels, int8x_stream  # noqa: E402

# (in, out) of each product
SHAPES = {
    "llama1b_qkv": (2048, 3072),
    "llama1b_o": (2048, 2048),
    "llama1b_gate_up": (2048, 16384),
    "llama1b_down": (8192, 2048),
    "smollm2_down": (1536, 576),
}
QUICK_SHAPES = ("llama1b_down", "smollm2_down")
ROWS = (1, 4, 8, 32, 64, 128)
QUICK_ROWS = (1, 8, 128)
# Past the 480 MB L3 of the machine these were first taken on, so that
# weights come from memory; the quick run settles for less.
WORKING_SET = 512 << 20
QUICK_WORKING_SET = 256 << 20
CALLS = {1: 16, 4: 16, 8: 12, 32: 6, 64: 4, 128: 3}  # calls timed per round, by rows
# where each type's fp16 scales sit in its super-block
HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator
                  ) -> KQuantBlocks:
    """Random bytes, with every fp16 d and dmin a moderate value."""
    block_bytes = FORMATS[type_name].block_bytes
    raw = rng.integers(0, 256, (rows, cols // SUPER_BLOCK, block_bytes), dtype=np.uint8)
    for at in HALVES[type_name]:
        scale = (rng.uniform(0.5, 2.0, raw.shape[:2]) * 1e-3).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return KQuantBlocks.from_gguf(f"random {type_name}", type_name, raw.reshape(rows, -1))


def copies(nbytes: int, working_set: int) -> int:
    return max(2, min(64, working_set // nbytes))


class System:
    """One way of computing a product: its weight copies, taken in turn."""

    def __init__(self, products: list[Callable[[torch.Tensor], torch.Tensor]],
                 nbytes: int) -> None:
        self.products, self.nbytes = products, nbytes
        self.turn = itertools.cycle(range(len(products)))

    def seconds(self, x: torch.Tensor, calls: int) -> float:
        times = []
        for _ in range(calls):
            product = self.products[next(self.turn)]
            start = time.perf_counter()
            product(x)
            times.append(time.perf_counter() - start)
        return float(np.median(times))


def systems_for(n_in: int, n_out: int, working_set: int, rng: np.random.Generator
                ) -> tuple[dict[str, System], dict[str, Any]]:
    """Every system on one shape, and the K types' layers for the error check."""
    systems: dict[str, System] = {}
    layers: dict[str, Any] = {}
    for type_name in FORMATS:
        blocks = random_blocks(type_name, n_out, n_in, rng)
        nbytes = blocks.data.numel()
        made = [KQuantLinear([KQuantBlocks(blocks.data.clone(), type_name)])
                for _ in range(copies(nbytes, working_set))]
        layers[type_name] = (made[0], blocks)
        systems[type_name.lower()] = System([m.int8_product for m in made], nbytes)
        if type_name == "Q4_K":
            systems["q4_k_dense"] = System([m.dense_product for m in made], nbytes)
    # Q4_0 blocks on int8x_gemv, as Int4Linear calls it (without the dense
    # copy it keeps for many rows on a CPU with AMX)
    scale = (torch.rand(n_out, n_in // 32) * 2e-3).half().float()
    tiles = int8x_stream(Int4Blocks(torch.randint(0, 16, (n_out, n_in), dtype=torch.uint8),
                                    scale, -8 * scale, 32))
    int8x_gemv = bf16_kernels().int8x_gemv  # type: ignore[union-attr]
    systems["q4_0_int8x"] = System(
        [lambda x, t=t: int8x_gemv(x, t) for t in
         [tiles.clone() for _ in range(copies(tiles.numel(), working_set))]], tiles.numel())
    dense = layers["Q4_K"][1].dequantize().bfloat16()
    weights = [dense.clone() for _ in range(copies(dense.numel() * 2, working_set))]
    packs = [PackedWeight() for _ in weights]
    systems["bf16"] = System([lambda x, w=w, p=p: cpu_linear(x, w, None, p)
                              for w, p in zip(weights, packs, strict=True)], dense.numel() * 2)
    return systems, layers


def errors(layers: dict[str, Any], n_in: int) -> dict[str, float]:
    """Each K type's int8 product against its weights' exact product, relative (norms)."""
    x = torch.randn(8, n_in).bfloat16()
    out = {}
    for type_name, (layer, blocks) in layers.items():
        exact = x.double() @ blocks.dequantize().double().T
        out[type_name.lower()] = float((layer.int8_product(x).double() - exact).norm()
                                       / exact.norm())
    return out


def shape_figures(name: str, quick: bool, rng: np.random.Generator) -> dict[str, Any]:
    n_in, n_out = SHAPES[name]
    systems, layers = systems_for(n_in, n_out, QUICK_WORKING_SET if quick else WORKING_SET, rng)
    figures: dict[str, Any] = {"in": n_in, "out": n_out,
                               "weight_bytes": {k: s.nbytes for k, s in systems.items()},
                               "int8_relative_error": errors(layers, n_in)}
    for rows in QUICK_ROWS if quick else ROWS:
        x = torch.randn(rows, n_in).bfloat16()
        runs: dict[str, Callable[[None], float]] = {
            k: (lambda _, s=s, x=x, calls=CALLS[rows]: s.seconds(x, calls))
            for k, s in systems.items()
            if k != "q4_k_dense" or rows >= 8}
        rates = memory_rates()
        spreads = rotated({**runs, "read_gb_s": rates["read_alone_gb_s"]}, None, None,
                          rounds(quick))
        rate = spreads.pop("read_gb_s")
        figures[f"rows_{rows}"] = {
            k: {"us": v.median * 1e6, "min_us": v.low * 1e6, "max_us": v.high * 1e6,
                "gb_s": systems[k].nbytes / v.median / 1e9,
                "floor_us": systems[k].nbytes / (rate.median * 1e9) * 1e6}
            for k, v in spreads.items()} | {"read_gb_s": rate.median}
    return figures


def headline(products: dict[str, Any]) -> dict[str, Any]:
    """Per shape and rows: us per product of each system, and Q4_K's ratios to Q4_0 and bf16."""
    out: dict[str, Any] = {}
    for shape, figures in products.items():
        for key, row in figures.items():
            if not key.startswith("rows_"):
                continue
            us = {k: round(v["us"], 1) for k, v in row.items() if isinstance(v, dict)}
            best_q4k = min(us["q4_k"], us.get("q4_k_dense", float("inf")))
            out[f"{shape}_{key}"] = us | {
                "q4_k_over_q4_0": round(best_q4k / us["q4_0_int8x"], 2),
                "q4_k_over_bf16": round(best_q4k / us["bf16"], 2),
                "q4_k_gb_s": round(row["q4_k"]["gb_s"], 1)}
    return out


def main() -> None:
    args = parse_args(__doc__)
    if kquant.kquant_kernels() is None or not int8x_kernels():
        raise SystemExit("no native kernels with AVX-512 VNNI here: nothing to measure")
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    products = {name: shape_figures(name, args.quick, rng)
                for name in (QUICK_SHAPES if args.quick else SHAPES)}
    finish("kquant", {"machine": machine(), "dense_from_rows": kquant.DENSE_FROM_ROWS,
                      "products": products, "headline": headline(products)})


if __name__ == "__main__":
    main()
