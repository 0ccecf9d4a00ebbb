"""The Triton kernels on a GPU at serving sizes, in one run: achieved memory
traffic as a fraction of a large device-to-device copy's, side by side with
torch's scaled_dot_product_attention over a contiguous cache of the same
contents (the no-paging baseline).

Traffic counts the bytes a kernel must move at least (every K/V row of a
context read once per KV head, q read and the output written once), read and
written alike, as does the copy's (size read + size written). Times are
medians of triton.testing.do_bench (eager launches) and of
do_bench_cudagraph (the launches replayed from a CUDA graph, as an engine
that captures its decode step sees them). Decode targets >= 75% of the
copy's traffic and no slower than contiguous SDPA.

Shapes: 32 and 256 sequences x 2048 positions (--quick: 32 x 1024), 32 query
heads, 8 KV heads, head dim 128 (a Llama-3-8B layer), and SmolLM2-135M's 9
query and 3 KV heads of 64; bf16, block size 16, blocks scattered over the
pool. For each: decode; a verification of k = 4 (5 positions per sequence)
through the short-span kernel (what TritonAttention runs) and through
paged_prefill; prefill chunks, write_kv and copy_blocks once.

--before FILE times an earlier paged_decode module (a copy of the file) on
the same inputs. --sweep times every launch configuration of the decode
kernel (tile, warps, stages, waves) and reports the best.

Writes results/kernels_gpu.json; the last line printed is the same JSON
object. Without CUDA it prints a `skipped` line and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import finish  # noqa: E402

DECODE_TARGET = 0.75  # fraction of copy traffic


def skip(reason: str) -> None:
    print(json.dumps({"bench": "kernels_gpu", "skipped": reason}))


def time_ms(fn: Callable[[], object], quick: bool) -> float:
    import triton.testing

    warmup, rep = (5, 20) if quick else (25, 200)
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graph_ms(fn: Callable[[], object], quick: bool) -> float | None:
    """Replayed from a CUDA graph (no launch overhead); None where fn does
    not capture."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=20 if quick else 100,
                                                       return_mode="median"))
    except RuntimeError:
        return None


def copy_traffic(quick: bool) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), quick)
    return 2 * src.numel() / (ms * 1e-3)


class Pool:
    """A paged cache of one layer, its sequences' blocks scattered, and the
    same contents laid out contiguously for SDPA."""

    def __init__(self, args: argparse.Namespace, spans: list[tuple[int, int]]) -> None:
        from specpage.attention.triton import TritonAttention
        from specpage.core.span import Span

        bs, kv_heads, d = args.block_size, args.kv_heads, args.head_dim
        context = spans[0][0] + spans[0][1]
        per_seq = -(-context // bs)
        num_blocks = per_seq * len(spans)
        order = torch.randperm(num_blocks).tolist()
        tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(len(spans))]
        self.meta = TritonAttention().build_metadata(
            [Span([1] * new, start, t) for (start, new), t in zip(spans, tables, strict=True)],
            bs,
            args.heads // kv_heads,
            torch.device("cuda"),
        )
        self.cache = torch.randn(
            2, num_blocks, bs, kv_heads, d, dtype=torch.bfloat16, device="cuda"
        )  # [2, num_blocks, block_size, kv_heads, head_dim]
        blocks = self.cache[:, self.meta.block_tables]  # [2, seqs, blocks, bs, kv, d]
        # [num_seqs, kv_heads, context, head_dim]
        self.k = blocks[0].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        self.v = blocks[1].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        self.kv_bytes = self.k.nbytes + self.v.nbytes


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def fraction(nbytes: int, ms: float, copy: float) -> float:
    return round(nbytes / (ms * 1e-3) / copy, 3)


def timings(name: str, fn: Callable[[], object], nbytes: int, copy: float,
            quick: bool) -> dict[str, Any]:
    ms, graph = time_ms(fn, quick), graph_ms(fn, quick)
    return {
        f"{name}ms": round(ms, 4),
        f"{name}fraction_of_copy": fraction(nbytes, ms, copy),
        f"{name}graph_ms": round(graph, 4) if graph else None,
        f"{name}graph_fraction_of_copy": fraction(nbytes, graph, copy) if graph else None,
    }


def load_module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("paged_decode_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_decode(args: argparse.Namespace, copy: float, num_seqs: int) -> dict[str, Any]:
    from specpage.kernels.triton.paged_decode import paged_decode

    pool = Pool(args, [(args.context - 1, 1)] * num_seqs)
    q = torch.randn(num_seqs, args.heads, args.head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    scale = args.head_dim**-0.5
    nbytes = pool.kv_bytes + q.nbytes + out.nbytes
    result: dict[str, Any] = {"num_seqs": num_seqs, "bytes": nbytes}
    result.update(timings("", lambda: paged_decode(q, pool.cache, pool.meta, scale, out),
                          nbytes, copy, args.quick))
    ours = out.clone()
    if args.before:
        before = load_module(args.before)
        result.update(timings("before_", lambda: before.paged_decode(
            q, pool.cache, pool.meta, scale, out), nbytes, copy, args.quick))
    # One query token attends to everything, so a KV head's query heads can
    # ride along the query axis: plain MHA-shaped SDPA, any backend.
    groups = args.heads // args.kv_heads
    q_rows = q.view(num_seqs, args.kv_heads, groups, args.head_dim)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_rows, pool.k, pool.v, scale=scale)

    result.update(timings("sdpa_", sdpa, nbytes, copy, args.quick))
    result["speedup_vs_sdpa"] = round(result["sdpa_ms"] / result["ms"], 3)
    if result["graph_ms"] and result["sdpa_graph_ms"]:
        result["graph_speedup_vs_sdpa"] = round(result["sdpa_graph_ms"] / result["graph_ms"], 3)
    result["rel_error_vs_sdpa"] = rel_error(ours, sdpa().reshape(out.shape))
    if args.sweep:
        result["sweep"] = sweep(pool, q, out, scale, nbytes, copy)
    return result


def sweep(pool: Pool, q: torch.Tensor, out: torch.Tensor, scale: float, nbytes: int,
          copy: float) -> dict[str, Any]:
    """Every launch configuration of the decode kernel, graph-replayed."""
    from specpage.kernels.triton.paged_decode import (
        DecodeConfig,
        _default_partition_size,
        paged_decode,
    )

    rows: list[dict[str, Any]] = []
    programs = q.shape[0] * pool.cache.shape[3]
    seen = set()
    for tile, warps, stages, waves in itertools.product(
            (32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4, 8)):
        config = DecodeConfig(tile=tile, tile_when_many=tile, num_warps=warps,
                              num_stages=stages, waves=waves, min_partition=128)
        partition = _default_partition_size(q.device, programs, pool.meta.max_context, config,
                                            tile)
        if (tile, warps, stages, partition) in seen:
            continue  # more waves that split no further
        seen.add((tile, warps, stages, partition))
        try:
            ms = graph_ms(lambda c=config: paged_decode(q, pool.cache, pool.meta, scale, out,
                                                        config=c), quick=True)
        except Exception as error:  # noqa: BLE001 - a config that fails to compile is a row
            rows.append({"config": config.__dict__, "error": str(error)[:120]})
            continue
        if ms:
            rows.append({"config": config.__dict__, "partition": partition,
                         "graph_ms": round(ms, 4), "fraction_of_copy": fraction(nbytes, ms, copy)})
    timed = sorted((r for r in rows if "graph_ms" in r), key=lambda r: r["graph_ms"])
    return {"tried": len(rows), "best": timed[:5], "failed": [r for r in rows if "error" in r][:3]}


def bench_spans(args: argparse.Namespace, copy: float, num_seqs: int, new: int) -> dict[str, Any]:
    from torch.nn.attention.bias import causal_lower_right

    from specpage.kernels.triton.paged_decode import paged_decode, takes_spans
    from specpage.kernels.triton.paged_prefill import paged_prefill

    pool = Pool(args, [(args.context - new, new)] * num_seqs)
    q = torch.randn(num_seqs * new, args.heads, args.head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    scale = args.head_dim**-0.5
    nbytes = pool.kv_bytes + q.nbytes + out.nbytes
    flops = 4 * num_seqs * args.heads * args.head_dim * (new * args.context - new * (new - 1) / 2)
    result: dict[str, Any] = {"num_seqs": num_seqs, "new_tokens": new, "bytes": nbytes}
    result.update(timings("prefill_kernel_", lambda: paged_prefill(
        q, pool.cache, pool.meta, scale, out), nbytes, copy, args.quick))
    result["prefill_kernel_tflops"] = round(flops / (result["prefill_kernel_ms"] * 1e-3) / 1e12, 2)
    ref = out.clone()
    if takes_spans(new, args.heads // args.kv_heads):
        result.update(timings("", lambda: paged_decode(q, pool.cache, pool.meta, scale, out),
                              nbytes, copy, args.quick))
        result["rel_error_vs_prefill_kernel"] = rel_error(out, ref)
    q_sdpa = q.view(num_seqs, new, args.heads, args.head_dim).transpose(1, 2)
    mask = causal_lower_right(new, args.context)  # span token i sees context - new + i

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_sdpa, pool.k, pool.v, attn_mask=mask, scale=scale, enable_gqa=True
        )

    try:
        sdpa_ms = time_ms(sdpa, args.quick)
    except (RuntimeError, TypeError, NotImplementedError) as error:
        result["sdpa_error"] = f"{type(error).__name__}: {error}"[:200]
        return result
    result.update(
        sdpa_ms=round(sdpa_ms, 4),
        sdpa_fraction_of_copy=fraction(nbytes, sdpa_ms, copy),
        rel_error_vs_sdpa=rel_error(ref, sdpa().transpose(1, 2).reshape(out.shape)),
    )
    return result


def bench_write_kv(args: argparse.Namespace, copy: float) -> dict[str, Any]:
    from specpage.kernels.triton.kv_write import write_kv

    num_tokens = args.num_seqs * 128  # e.g. one 128-token prefill chunk per sequence
    pool = Pool(args, [(args.context - 128, 128)] * args.num_seqs)
    shape = (num_tokens, args.kv_heads, args.head_dim)
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    slots = pool.meta.slot_mapping
    ms = time_ms(lambda: write_kv(pool.cache, k, v, slots), args.quick)
    nbytes = 2 * (k.nbytes + v.nbytes) + slots.nbytes
    return {
        "tokens": num_tokens,
        "ms": round(ms, 4),
        "fraction_of_copy": fraction(nbytes, ms, copy),
    }


def bench_copy_blocks(args: argparse.Namespace, copy: float) -> dict[str, Any]:
    from specpage.kernels.triton.block_copy import copy_blocks

    layers, num_blocks, num_pairs = (8, 1024, 256) if args.quick else (32, 2048, 512)
    shape = (layers, 2, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    blocks = torch.randperm(num_blocks, device="cuda")
    pairs = torch.stack([blocks[:num_pairs], blocks[num_pairs : 2 * num_pairs]], dim=1)
    ms = time_ms(lambda: copy_blocks(cache, pairs), args.quick)
    nbytes = 2 * num_pairs * cache[:, :, 0].nbytes
    return {
        "layers": layers,
        "pairs": num_pairs,
        "ms": round(ms, 4),
        "fraction_of_copy": fraction(nbytes, ms, copy),
    }


def shape_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"context": args.context, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "block_size": args.block_size, "dtype": "bfloat16"}


def attention_rows(args: argparse.Namespace, copy: float, counts: list[int]) -> dict[str, Any]:
    """Decode and a k = 4 verification at each sequence count, one head shape."""
    rows: dict[str, Any] = {"shape": shape_of(args)}
    for num_seqs in counts:
        decode = bench_decode(args, copy, num_seqs)
        verify = bench_spans(args, copy, num_seqs, 5)
        if "ms" in verify:
            # the whole span against decoding one token, and per position
            verify["vs_decode"] = round(verify["ms"] / decode["ms"], 3)
            verify["per_position_vs_decode"] = round(verify["ms"] / 5 / decode["ms"], 3)
        rows[f"{num_seqs}seqs"] = {"decode": decode, "verify_k4": verify}
        print(json.dumps({"heads": args.heads, "num_seqs": num_seqs, "decode": decode,
                          "verify_k4": verify}), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--num-seqs", default="32,256", help="sequence counts, comma-separated")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--before", type=Path, help="an earlier paged_decode module to time too")
    parser.add_argument("--sweep", action="store_true", help="time every decode launch config")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        skip("no CUDA device")
        return
    from specpage.kernels.triton import is_interpreted
    from specpage.kernels.triton.paged_decode import DEFAULT_CONFIG, _paged_spans_kernel

    if is_interpreted(_paged_spans_kernel):
        skip("TRITON_INTERPRET is set")
        return
    counts = [int(n) for n in args.num_seqs.split(",")]
    if args.quick:
        counts, args.context = [min(counts[0], 32)], min(args.context, 1024)
    torch.manual_seed(0)
    copy = copy_traffic(args.quick)
    result: dict[str, Any] = {
        "bench": "kernels_gpu",
        "device": torch.cuda.get_device_name(),
        "quick": args.quick,
        "decode_config": DEFAULT_CONFIG.__dict__,
        "copy_traffic_gb_s": round(copy / 1e9, 1),
        "llama_8b_layer": attention_rows(args, copy, counts),
    }
    small = argparse.Namespace(**{**vars(args), "heads": 9, "kv_heads": 3, "head_dim": 64})
    result["smollm2_layer"] = attention_rows(small, copy, counts)
    decodes = [row["decode"] for rows in (result["llama_8b_layer"], result["smollm2_layer"])
               for key, row in rows.items() if key != "shape"]
    result["decode_meets_target"] = all(
        d["fraction_of_copy"] >= DECODE_TARGET and d["speedup_vs_sdpa"] >= 1.0 for d in decodes)
    args.num_seqs = max(1, counts[0] // 4)
    result["prefill_chunk"] = bench_spans(args, copy, max(1, counts[0] // 4), 512)
    args.num_seqs = counts[0]
    result["write_kv"] = bench_write_kv(args, copy)
    result["copy_blocks"] = bench_copy_blocks(args, copy)
    finish("kernels_gpu", result)


if __name__ == "__main__":
    main()
